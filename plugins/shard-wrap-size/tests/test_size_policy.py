"""The size wrap policy, registered in memory the way its entry point registers it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from torch import nn
from torch.distributed.fsdp.wrap import _recursive_wrap, size_based_auto_wrap_policy

import shard_wrap_size
from shard_core import Registry, WrapPlanError, WrapTarget, make_plugin_manager, plan_wraps
from shard_core.protocols import WrapPolicy
from shard_wrap_size import (
    DEFAULT_EXCLUDE_WRAP_MODULES,
    DEFAULT_FORCE_LEAF_MODULES,
    SizeWrapPolicy,
)
from shard_wrap_size import plugin as size_plugin


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)  # 40 elements
        self.fc2 = nn.Linear(8, 4)  # 36 elements


class Net(nn.Module):
    """282 parameter elements: embed 40, blocks 2 x 76 (a ModuleList), attn 80, head 10."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([MLP(), MLP()])
        self.attn = nn.MultiheadAttention(4, 2)  # in_proj 60, out_proj 20
        self.head = nn.Linear(4, 2)


def encoder() -> nn.TransformerEncoder:
    """A torch transformer: a ModuleList of 2 layers, each holding a MultiheadAttention."""
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    return nn.TransformerEncoder(layer, 2)


def registry() -> Registry:
    pm = make_plugin_manager(load_entry_points=False)
    pm.register(size_plugin, name="wrap-size")
    return Registry(pm)


def summary(plan: list[WrapTarget]) -> list[tuple[str, int]]:
    return [(t.name, t.numel) for t in plan]


def torch_plan(model: nn.Module, **policy_options: Any) -> list[str]:
    """The units PyTorch's own size policy makes of ``model``, in wrapping order, root last."""
    wrapped: list[nn.Module] = []

    def record(module: nn.Module, **_: Any) -> nn.Module:
        wrapped.append(module)
        return module

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return size_based_auto_wrap_policy(module, recurse, nonwrapped_numel, **policy_options)

    _recursive_wrap(model, policy, record, set(), set(), only_wrap_children=True)
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(m)] for m in wrapped] + [""]


def test_plugin_registers_size() -> None:
    """The plugin module's hook adds "size" next to the built-in policies."""
    reg = registry()
    assert reg.wrap_policies()["size"] is SizeWrapPolicy
    assert reg.plugin_names() == ["builtins", "wrap-size"]


def test_registry_builds_the_policy_with_options() -> None:
    """wrap_policy("size", min_num_params=...) builds a SizeWrapPolicy with that threshold."""
    policy = registry().wrap_policy("size", min_num_params=1000)
    assert isinstance(policy, SizeWrapPolicy)
    assert isinstance(policy, WrapPolicy)
    assert policy.min_num_params == 1000


def test_defaults_are_pytorchs() -> None:
    """Defaults: 1e8 elements, MultiheadAttention a leaf, ModuleList/ModuleDict excluded."""
    policy = SizeWrapPolicy()
    assert policy.min_num_params == 100_000_000
    assert policy.force_leaf_modules == DEFAULT_FORCE_LEAF_MODULES == {nn.MultiheadAttention}
    assert policy.exclude_wrap_modules == DEFAULT_EXCLUDE_WRAP_MODULES
    assert policy.exclude_wrap_modules == {nn.ModuleList, nn.ModuleDict}
    assert DEFAULT_FORCE_LEAF_MODULES == size_based_auto_wrap_policy.FORCE_LEAF_MODULES  # type: ignore[attr-defined]
    assert DEFAULT_EXCLUDE_WRAP_MODULES == size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("min_num_params", "expected"),
    [
        # Each fc1 reaches 40 on its own; the fc2s (36) stay with the root.
        (40, [("embed", 40), ("blocks.0.fc1", 40), ("blocks.1.fc1", 40), ("", 162)]),
        # One more element: no Linear alone is enough, each MLP (76) is.
        (41, [("blocks.0", 76), ("blocks.1", 76), ("", 130)]),
        (76, [("blocks.0", 76), ("blocks.1", 76), ("", 130)]),
        # The MLPs fall short; their ModuleList (152) is never a unit.
        (77, [("", 282)]),
        (283, [("", 282)]),
    ],
)
def test_threshold_boundaries(min_num_params: int, expected: list[tuple[str, int]]) -> None:
    """A module becomes a unit exactly when its unclaimed elements reach the threshold."""
    model = Net()
    plan = plan_wraps(model, SizeWrapPolicy(min_num_params))
    assert summary(plan) == expected
    assert plan[-1].module is model


def test_zero_threshold_makes_every_eligible_module_a_unit() -> None:
    """min_num_params=0 wraps every module, parameterless ones included, but no container."""
    plan = plan_wraps(Net(), SizeWrapPolicy(0))
    assert summary(plan) == [
        ("embed", 40),
        ("blocks.0.fc1", 40),
        ("blocks.0.fc2", 36),
        ("blocks.0", 0),
        ("blocks.1.fc1", 40),
        ("blocks.1.fc2", 36),
        ("blocks.1", 0),
        ("head", 10),
        ("", 80),
    ]


def test_multihead_attention_is_a_leaf_by_default() -> None:
    """Neither MultiheadAttention nor its out_proj (20) becomes a unit; its 80 go to the root."""
    policy = SizeWrapPolicy(20)
    assert policy.descend(nn.MultiheadAttention(4, 2), "attn") is False
    assert policy.descend(MLP(), "blocks.0") is True
    assert summary(plan_wraps(Net(), policy)) == [
        ("embed", 40),
        ("blocks.0.fc1", 40),
        ("blocks.0.fc2", 36),
        ("blocks.1.fc1", 40),
        ("blocks.1.fc2", 36),
        ("", 90),
    ]


def test_empty_force_leaf_set_lets_the_walk_enter_attention() -> None:
    """force_leaf_modules=set() replaces the default: out_proj, then the rest of attn, are units."""
    plan = plan_wraps(Net(), SizeWrapPolicy(20, force_leaf_modules=set()))
    assert summary(plan)[-3:] == [("attn.out_proj", 20), ("attn", 60), ("", 10)]


def test_excluded_classes_never_become_units() -> None:
    """exclude_wrap_modules={Embedding} keeps embed out; containers stay excluded regardless."""
    policy = SizeWrapPolicy(40, exclude_wrap_modules={nn.Embedding})
    assert policy.exclude_wrap_modules == {nn.Embedding}
    assert summary(plan_wraps(Net(), policy)) == [
        ("blocks.0.fc1", 40),
        ("blocks.1.fc1", 40),
        ("", 202),
    ]
    # The ModuleList (152 unclaimed) would reach 77, but a container is never a unit.
    assert summary(plan_wraps(Net(), SizeWrapPolicy(77, exclude_wrap_modules=set()))) == [("", 282)]


def test_single_classes_and_numpy_ints_are_accepted() -> None:
    """One class stands for a set of one; a numpy integer threshold becomes an int."""
    policy = SizeWrapPolicy(np.int64(1000), force_leaf_modules=MLP, exclude_wrap_modules=nn.Linear)  # type: ignore[arg-type]
    assert policy.min_num_params == 1000
    assert type(policy.min_num_params) is int
    assert policy.force_leaf_modules == {MLP}
    assert policy.exclude_wrap_modules == {nn.Linear}


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"force_leaf_modules": set()},
        {"exclude_wrap_modules": {nn.ModuleList, nn.ModuleDict, nn.Embedding}},
        {"force_leaf_modules": {MLP, nn.MultiheadAttention}},
    ],
)
@pytest.mark.parametrize("make_model", [Net, encoder])
def test_same_units_as_pytorch_at_every_threshold(
    options: dict[str, Any], make_model: type[nn.Module]
) -> None:
    """At every threshold from 0 to the model's size + 1, the units are PyTorch's, in order."""
    model = make_model()
    total = sum(p.numel() for p in model.parameters())
    for threshold in range(total + 2):
        ours = [t.name for t in plan_wraps(model, SizeWrapPolicy(threshold, **options))]
        assert ours == torch_plan(model, min_num_params=threshold, **options), threshold


def test_repr_names_the_options() -> None:
    """The repr shows the threshold and both class sets, sorted by name."""
    assert repr(SizeWrapPolicy(1000)) == (
        "SizeWrapPolicy(min_num_params=1000, force_leaf_modules={MultiheadAttention}, "
        "exclude_wrap_modules={ModuleDict, ModuleList})"
    )
    assert repr(SizeWrapPolicy(5, force_leaf_modules=set(), exclude_wrap_modules=[MLP])) == (
        "SizeWrapPolicy(min_num_params=5, force_leaf_modules=set(), exclude_wrap_modules={MLP})"
    )


def test_negative_threshold_is_rejected() -> None:
    """A negative min_num_params is refused, naming the argument and the value."""
    with pytest.raises(
        WrapPlanError,
        match=r"^SizeWrapPolicy: min_num_params must be >= 0, got -1; it is the number of "
        r"parameter elements at which a module becomes a unit$",
    ):
        SizeWrapPolicy(-1)


@pytest.mark.parametrize(
    ("value", "shown"), [(1e6, r"1000000\.0 \(float\)"), (True, r"True \(bool\)")]
)
def test_non_int_threshold_is_rejected(value: object, shown: str) -> None:
    """A float or bool min_num_params is refused with the value seen and int(...) as the fix."""
    with pytest.raises(
        WrapPlanError,
        match=rf"^SizeWrapPolicy: min_num_params must be an int, got {shown}; pass a whole "
        r"number of parameter elements, e.g. min_num_params=int\(1e8\)$",
    ):
        SizeWrapPolicy(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("argument", ["force_leaf_modules", "exclude_wrap_modules"])
def test_non_class_entries_are_rejected(argument: str) -> None:
    """A class set holding a name instead of a class is refused, naming the argument and entry."""
    with pytest.raises(
        WrapPlanError,
        match=rf"^SizeWrapPolicy: {argument} must hold nn.Module subclasses, got "
        rf"'MultiheadAttention' \(str\); pass the class itself, e.g. "
        rf"{argument}=\{{nn.MultiheadAttention\}}$",
    ):
        SizeWrapPolicy(10, **{argument: {"MultiheadAttention"}})  # type: ignore[arg-type]


def test_non_module_class_is_rejected() -> None:
    """A class that is not an nn.Module subclass is refused, shown as the class."""
    with pytest.raises(
        WrapPlanError,
        match=r"^SizeWrapPolicy: exclude_wrap_modules must hold nn.Module subclasses, got "
        r"<class 'int'> \(type\);",
    ):
        SizeWrapPolicy(10, exclude_wrap_modules=[int])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("value", "shown"), [("ModuleList", r"'ModuleList' \(str\)"), (3, r"3 \(int\)")]
)
def test_non_set_class_argument_is_rejected(value: object, shown: str) -> None:
    """A class argument that is a string or not iterable is refused, naming the argument."""
    with pytest.raises(
        WrapPlanError,
        match=rf"^SizeWrapPolicy: exclude_wrap_modules must be a set of nn.Module subclasses, "
        rf"got {shown}; pass e.g. exclude_wrap_modules=\{{nn.MultiheadAttention\}}$",
    ):
        SizeWrapPolicy(10, exclude_wrap_modules=value)  # type: ignore[arg-type]


def test_package_exports() -> None:
    """The package's public names are the policy, its two default class sets and the version."""
    assert shard_wrap_size.__all__ == [
        "DEFAULT_EXCLUDE_WRAP_MODULES",
        "DEFAULT_FORCE_LEAF_MODULES",
        "SizeWrapPolicy",
        "__version__",
    ]
