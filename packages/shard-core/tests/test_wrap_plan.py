"""plan_wraps: the post-order walk that turns a wrap policy into the list of units."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from torch import nn

from shard_core import CustomPolicy, ModuleWrapPolicy, WrapPlanError, WrapTarget, plan_wraps
from shard_core.protocols import WrapDecision


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(4, 4)  # 20 elements
        self.mlp = nn.Linear(4, 2)  # 10 elements


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)  # 40 elements
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 3)  # 15 elements


def summary(plan: list[WrapTarget]) -> list[tuple[str, int, dict[str, Any]]]:
    return [(t.name, t.numel, dict(t.overrides)) for t in plan]


class RecordingPolicy:
    """Wraps the names in ``units`` (with optional overrides); records every question asked."""

    def __init__(
        self,
        units: Mapping[str, WrapDecision] | None = None,
        no_descend: frozenset[str] = frozenset(),
    ) -> None:
        self.units = dict(units or {})
        self.no_descend = no_descend
        self.asked: list[tuple[str, int]] = []

    def descend(self, module: nn.Module, name: str) -> bool:
        return name not in self.no_descend

    def wrap(self, module: nn.Module, name: str, unwrapped_numel: int) -> WrapDecision:
        self.asked.append((name, unwrapped_numel))
        return self.units.get(name, False)

    def __repr__(self) -> str:
        return "RecordingPolicy()"


def test_module_policy_plans_blocks_then_root() -> None:
    """Each Block is a unit and the root keeps the rest, children before parents."""
    model = Net()
    plan = plan_wraps(model, ModuleWrapPolicy({Block}))
    assert summary(plan) == [("layers.0", 30, {}), ("layers.1", 30, {}), ("", 55, {})]
    assert [t.module for t in plan] == [model.layers[0], model.layers[1], model]


def test_nested_units_claim_parameters_bottom_up() -> None:
    """A unit above other units manages only what they left; the visiting order is post-order."""
    policy = RecordingPolicy({"layers.0.attn": True, "layers.0": True, "head": True})
    plan = plan_wraps(Net(), policy)
    assert summary(plan) == [
        ("layers.0.attn", 20, {}),
        ("layers.0", 10, {}),
        ("head", 15, {}),
        ("", 70, {}),
    ]
    assert policy.asked == [
        ("embed", 40),
        ("layers.0.attn", 20),
        ("layers.0.mlp", 10),
        ("layers.0", 10),
        ("layers.1.attn", 20),
        ("layers.1.mlp", 10),
        ("layers.1", 30),
        ("layers", 30),
        ("head", 15),
        ("", 70),
    ]


def test_no_policy_makes_the_root_the_only_unit() -> None:
    """With policy=None the whole model is one unit."""
    assert summary(plan_wraps(Net(), None)) == [("", 115, {})]


def test_root_is_a_unit_even_when_the_policy_declines() -> None:
    """The root is always the last unit, with empty overrides when the policy said False."""
    policy = RecordingPolicy()
    assert summary(plan_wraps(Net(), policy)) == [("", 115, {})]
    assert policy.asked[-1] == ("", 115)


def test_policy_mappings_become_overrides_for_that_unit() -> None:
    """A mapping answer makes a unit whose overrides are that mapping, the root's included."""
    policy = CustomPolicy(
        lambda m: (
            {"reshard_after_forward": False}
            if isinstance(m, Block)
            else ({"mixed_precision": None} if isinstance(m, Net) else False)
        )
    )
    plan = plan_wraps(Net(), policy)
    assert summary(plan) == [
        ("layers.0", 30, {"reshard_after_forward": False}),
        ("layers.1", 30, {"reshard_after_forward": False}),
        ("", 55, {"mixed_precision": None}),
    ]
    with pytest.raises(TypeError):
        plan[0].overrides["reshard_after_forward"] = True  # type: ignore[index]


def test_descend_false_keeps_the_walker_out_of_a_subtree() -> None:
    """A module that is not descended into is asked with its whole subtree; its children never."""
    policy = RecordingPolicy({"layers.0": True}, no_descend=frozenset({"layers.0", "layers.1"}))
    plan = plan_wraps(Net(), policy)
    assert summary(plan) == [("layers.0", 30, {}), ("", 85, {})]
    assert policy.asked == [
        ("embed", 40),
        ("layers.0", 30),
        ("layers.1", 30),
        ("layers", 30),
        ("head", 15),
        ("", 85),
    ]


def test_descend_false_at_the_root_asks_only_the_root() -> None:
    """A policy that does not descend into the root makes one unit of everything."""
    policy = RecordingPolicy(no_descend=frozenset({""}))
    assert summary(plan_wraps(Net(), policy)) == [("", 115, {})]
    assert policy.asked == [("", 115)]


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Sequential(nn.Linear(4, 4, bias=False))
        self.right = nn.Sequential(nn.Linear(4, 4, bias=False))
        self.right[0].weight = self.left[0].weight


def test_shared_parameters_are_counted_once() -> None:
    """A parameter reachable from two modules counts once, for the first unit that claims it."""
    assert summary(plan_wraps(Tied(), None)) == [("", 16, {})]
    plan = plan_wraps(Tied(), ModuleWrapPolicy(nn.Linear))
    assert summary(plan) == [("left.0", 16, {}), ("right.0", 0, {}), ("", 0, {})]


def test_shared_parameter_claimed_by_a_later_sibling_is_not_counted_above() -> None:
    """A parameter left by one subtree but claimed by a later unit is not counted by the root."""
    policy = RecordingPolicy({"right": True})
    assert summary(plan_wraps(Tied(), policy)) == [("right", 16, {}), ("", 0, {})]
    assert policy.asked == [("left.0", 16), ("left", 16), ("right.0", 16), ("right", 16), ("", 0)]


def test_module_reachable_twice_is_visited_once() -> None:
    """A submodule under two parents is visited under its first name only."""
    model = nn.Module()
    shared = nn.Linear(2, 2)
    model.a = nn.Sequential(shared)
    model.b = nn.Sequential(shared)
    policy = RecordingPolicy({"a.0": True, "b.0": True})
    assert summary(plan_wraps(model, policy)) == [("a.0", 6, {}), ("", 0, {})]
    assert [name for name, _ in policy.asked] == ["a.0", "a", "b", ""]


def test_ignored_modules_and_parameters_are_skipped() -> None:
    """Ignored modules are never asked and ignored parameters are never counted."""
    model = Net()
    policy = RecordingPolicy({"layers.0": True})
    plan = plan_wraps(
        model, policy, ignored_modules=[model.layers[1]], ignored_params=[model.embed.weight]
    )
    assert summary(plan) == [("layers.0", 30, {}), ("", 15, {})]
    assert [name for name, _ in policy.asked] == [
        "embed",
        "layers.0.attn",
        "layers.0.mlp",
        "layers.0",
        "layers",
        "head",
        "",
    ]


def test_ignored_module_parameters_are_excluded_when_not_descending() -> None:
    """Parameters of an ignored module inside a subtree the walker skips are still left out."""
    model = Net()
    policy = RecordingPolicy(no_descend=frozenset({""}))
    plan = plan_wraps(model, policy, ignored_modules=[model.head])
    assert summary(plan) == [("", 100, {})]


def test_container_chosen_by_the_policy_is_an_error() -> None:
    """A policy naming ModuleList is told to wrap the container's children instead."""
    with pytest.raises(
        WrapPlanError,
        match=r"^module 'layers' \(ModuleList\) was chosen by the wrap policy, but a ModuleList "
        r"has no forward, so it cannot be a unit; wrap its children instead \(name their class "
        r"in the policy, or make each child a unit\)$",
    ):
        plan_wraps(Net(), ModuleWrapPolicy(nn.ModuleList))


def test_container_root_is_an_error() -> None:
    """A ModuleDict root cannot be the unit the root must be."""
    with pytest.raises(
        WrapPlanError,
        match=r"^module '' \(the root\) \(ModuleDict\) is the root, which is always a unit, "
        r"but a ModuleDict has no forward",
    ):
        plan_wraps(nn.ModuleDict({"a": nn.Linear(1, 1)}), None)


@pytest.mark.parametrize(
    ("answer", "shown"),
    [(None, "None (NoneType)"), (1, "1 (int)"), ({1: True}, "{1: True} (dict)")],
)
def test_malformed_policy_answers_are_errors(answer: object, shown: str) -> None:
    """An answer that is not a bool or a str-keyed mapping names the policy and the module."""
    policy = RecordingPolicy({"head": answer})  # type: ignore[dict-item]
    with pytest.raises(WrapPlanError) as info:
        plan_wraps(Net(), policy)
    assert str(info.value) == (
        f"wrap policy RecordingPolicy() answered {shown} for module 'head' (Linear); a wrap "
        f"policy answers True, False, or a mapping of keyword overrides with string keys"
    )


def test_policy_must_be_a_wrap_policy() -> None:
    """Passing a policy name or a function instead of a policy object says how to build one."""
    with pytest.raises(
        WrapPlanError,
        match=r"^policy must be a WrapPolicy \(an object with descend\(\) and wrap\(\)\) or None, "
        r"got str; registered policies are built with "
        r"shard_core.get_registry\(\).wrap_policy\(name, \*\*options\)$",
    ):
        plan_wraps(Net(), "module_class")  # type: ignore[arg-type]


def test_ignoring_the_root_is_an_error() -> None:
    """The root cannot be ignored, since it is always a unit."""
    model = Net()
    with pytest.raises(
        WrapPlanError,
        match=r"^the root module \(Net\) is in ignored_modules; the root is always a unit: "
        r"remove it from ignored_modules$",
    ):
        plan_wraps(model, None, ignored_modules=[model])
