"""Wrap policies in the runtime: every accepted form, tied-parameter folding, apply_wrap_policy.

Resolution and planning are pure and run in this process (registered names
through an in-memory registry); ``apply_wrap_policy`` runs on two gloo ranks
of the shared pool and trains like one process.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp.wrap import CustomPolicy as TorchCustomPolicy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy
from torch.distributed.fsdp.wrap import (
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from torch.distributed.tensor import DTensor

from shard_core import (
    CustomPolicy,
    ModuleWrapPolicy,
    Registry,
    WrapPlanError,
    hookimpl,
    make_plugin_manager,
    plan_wraps,
)
from shard_core.errors import PluginCallError, UnknownPluginNameError
from shard_core.protocols import WrapPolicy
from shard_runtime import FSDPModule, fully_shard
from shard_runtime._state import get_state
from shard_runtime._wrap_policy import apply_wrap_policy, plan_units, resolve_wrap_policy
from shard_testing import (
    Batch,
    RankPool,
    assert_state_dicts_equal,
    make_batches,
    train_reference,
)

VOCAB, DIM, SEQ = 13, 8, 5
BLOCKS = ["blocks.0", "blocks.1", "blocks.2"]
ACCEPTED = (
    "None, a WrapPolicy (an object with descend() and wrap()), a registered policy name "
    "such as 'transformer', a (name, options) tuple such as ('size', {'min_num_params': "
    "10000}), a set of nn.Module classes, or PyTorch's callable policy fn(module, recurse, "
    "nonwrapped_numel) -> bool"
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)  # 16 elements
        self.proj = nn.Linear(DIM, DIM)  # 72 elements

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.tanh(self.norm(x)))


class GPT(nn.Module):
    """Embedding (104), three blocks (88 each), final norm (16), head (104, or tied)."""

    def __init__(self, *, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Staged(nn.Module):
    """A stage of three blocks, then a tail block: units can nest two deep."""

    def __init__(self) -> None:
        super().__init__()
        self.stage = Stage()
        self.tail = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.stage(x))


class NamePolicy:
    """Wraps exactly the modules with the given qualified names."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self.names = set(names)

    def descend(self, module: nn.Module, name: str) -> bool:
        return True

    def wrap(self, module: nn.Module, name: str, unwrapped_numel: int) -> bool:
        return name in self.names


class _TestPolicies:
    @hookimpl
    def shard_wrap_policies(self) -> Mapping[str, Callable[..., WrapPolicy]]:
        return {"names": NamePolicy}


@pytest.fixture
def registry() -> Registry:
    pm = make_plugin_manager(load_entry_points=False)
    pm.register(_TestPolicies(), name="test-policies")
    return Registry(pm)


def _units(root: nn.Module, policy: Any) -> list[str]:
    return [t.name for t in plan_units(root, resolve_wrap_policy(policy))]


# ---------------------------------------------------------------------- resolution


def test_resolve_none_and_policy_objects() -> None:
    """None stays None and a WrapPolicy object is returned as is."""
    policy = NamePolicy(["embed"])
    assert resolve_wrap_policy(None) is None
    assert resolve_wrap_policy(policy) is policy


def test_resolve_registered_name(registry: Registry) -> None:
    """A registered name builds that factory's policy with no options."""
    policy = resolve_wrap_policy("names", registry=registry)
    assert isinstance(policy, NamePolicy)
    assert policy.names == set()


def test_resolve_name_with_options(registry: Registry) -> None:
    """A (name, options) tuple passes the options to the factory, built-ins included."""
    named = resolve_wrap_policy(("names", {"names": ["embed", "head"]}), registry=registry)
    assert isinstance(named, NamePolicy)
    assert named.names == {"embed", "head"}
    by_class = resolve_wrap_policy(("module_class", {"module_classes": {Block}}), registry=registry)
    assert isinstance(by_class, ModuleWrapPolicy)
    assert by_class.module_classes == (Block,)


@pytest.mark.parametrize(
    ("classes", "expected"),
    [
        ({Block}, (Block,)),
        (frozenset({Block}), (Block,)),
        ([Block, nn.Embedding], (Block, nn.Embedding)),
        ((nn.Embedding, Block), (nn.Embedding, Block)),
        (Block, (Block,)),
    ],
    ids=["set", "frozenset", "list", "tuple", "class"],
)
def test_resolve_module_classes(classes: Any, expected: tuple[type[nn.Module], ...]) -> None:
    """Module classes (one, or a set, frozenset, list or tuple) become a ModuleWrapPolicy."""
    policy = resolve_wrap_policy(classes)
    assert isinstance(policy, ModuleWrapPolicy)
    assert policy.module_classes == expected


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (
            functools.partial(size_based_auto_wrap_policy, min_num_params=80),
            ["embed", *BLOCKS, "head", ""],
        ),
        (
            functools.partial(size_based_auto_wrap_policy, min_num_params=100),
            ["embed", "head", ""],
        ),
        (
            functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, Block)),
            [*BLOCKS, ""],
        ),
        (
            functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
            [*BLOCKS, ""],
        ),
        (TorchModuleWrapPolicy({Block, nn.Embedding}), ["embed", *BLOCKS, ""]),
    ],
    ids=["size-80", "size-100", "lambda", "transformer", "torch-module-wrap-policy"],
)
def test_resolve_pytorch_callable_policies(policy: Any, expected: list[str]) -> None:
    """PyTorch's callable policies plan the units PyTorch's own auto-wrap would make."""
    assert _units(GPT(tied=False), policy) == expected


def test_pytorch_size_policy_does_not_enter_small_subtrees() -> None:
    """The adapter asks recurse=True with the subtree's size: below the threshold, no descent,
    and (as in PyTorch's recursive wrap) the module is then not asked recurse=False either."""
    calls: list[tuple[str, bool, int]] = []

    def spy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        calls.append((type(module).__name__, recurse, nonwrapped_numel))
        return size_based_auto_wrap_policy(module, recurse, nonwrapped_numel, min_num_params=100)

    assert _units(Block(), spy) == [""]
    assert calls == [("Block", True, 88)]


def test_resolve_unknown_name_lists_registered(registry: Registry) -> None:
    """An unknown name raises the registry's error, which lists the registered names."""
    message = (
        "no wrap policy is registered as 'nmaes'; registered: 'lambda', 'module_class', "
        "'names'. Did you mean 'names'?"
    )
    with pytest.raises(UnknownPluginNameError, match=f"^{re.escape(message)}$"):
        resolve_wrap_policy("nmaes", registry=registry)


def test_resolve_bad_options_names_the_policy(registry: Registry) -> None:
    """Options the factory does not take are a WrapPlanError naming the policy and its signature.

    The check is shard-core's (the registry's), so the registry and the
    runtime give the same message.
    """
    message = (
        "wrap policy 'names' does not take the options {'nmes': ['embed']}: got an unexpected "
        "keyword argument 'nmes'; its options are: names=()"
    )
    with pytest.raises(WrapPlanError, match=f"^{re.escape(message)}$"):
        resolve_wrap_policy(("names", {"nmes": ["embed"]}), registry=registry)
    with pytest.raises(WrapPlanError, match=f"^{re.escape(message)}$"):
        registry.wrap_policy("names", nmes=["embed"])


class _RaisingPolicy(NamePolicy):
    def wrap(self, module: nn.Module, name: str, unwrapped_numel: int) -> bool:
        if name == "blocks.1":
            raise KeyError("oops in wrap")
        return super().wrap(module, name, unwrapped_numel)

    def __repr__(self) -> str:
        return "RaisingPolicy()"


def test_policy_raising_in_wrap_names_the_module() -> None:
    """A policy's exception reaches the planner's caller naming the module and the code's module.

    It is a PluginCallError chained to the original, and still a KeyError.
    """
    with pytest.raises(KeyError) as info:
        plan_units(GPT(tied=False), resolve_wrap_policy(_RaisingPolicy(["blocks.0"])))
    error = info.value
    assert isinstance(error, PluginCallError)
    assert isinstance(error.__cause__, KeyError)
    message = (
        "wrap policy RaisingPolicy() raised KeyError: 'oops in wrap' in wrap() for module "
        f"'blocks.1' (Block). It was raised in your code, module {__name__!r} ({__file__}:"
    )
    assert re.fullmatch(
        f"{re.escape(message)}\\d+\\): see the original exception above", str(error)
    ), str(error)


@pytest.mark.parametrize(
    "policy",
    [("names", "embed"), ("names", {"names": ["embed"]}, 3), ("names", {1: 2})],
    ids=["options-not-a-mapping", "three-items", "non-string-key"],
)
def test_resolve_malformed_named_tuple(registry: Registry, policy: tuple[Any, ...]) -> None:
    """A tuple starting with a name must be exactly (name, mapping of keyword options)."""
    message = (
        f"wrap policy {policy!r}: a named policy with options is a (name, options) tuple whose "
        "options are a mapping of keyword arguments, e.g. ('size', {'min_num_params': 10000})"
    )
    with pytest.raises(WrapPlanError, match=f"^{re.escape(message)}$"):
        resolve_wrap_policy(policy, registry=registry)


def test_resolve_unsupported_value() -> None:
    """A value of no accepted form is a WrapPlanError (ValueError) naming its type and the forms."""
    with pytest.raises(
        ValueError, match=f"^{re.escape(f'cannot use 3 (int) as a wrap policy; pass {ACCEPTED}')}$"
    ):
        resolve_wrap_policy(3)  # type: ignore[arg-type]


def test_resolve_torch_custom_policy_points_to_ours() -> None:
    """PyTorch's (non-callable) CustomPolicy gets the accepted forms and a pointer to shard's."""
    policy = TorchCustomPolicy(lambda m: isinstance(m, Block))
    message = (
        f"cannot use {policy!r} (CustomPolicy) as a wrap policy; pass {ACCEPTED}. For PyTorch's "
        "CustomPolicy, use shard's class of the same name from shard_runtime (same arguments)"
    )
    with pytest.raises(WrapPlanError, match=f"^{re.escape(message)}$"):
        resolve_wrap_policy(policy)  # type: ignore[arg-type]


def test_resolve_policy_class_instead_of_instance() -> None:
    """A policy class (not an instance) is refused with the fix."""
    message = (
        "wrap policy ModuleWrapPolicy is a class, not a policy; pass an instance: "
        "ModuleWrapPolicy(...)"
    )
    with pytest.raises(WrapPlanError, match=f"^{re.escape(message)}$"):
        resolve_wrap_policy(ModuleWrapPolicy)  # type: ignore[arg-type]


def test_resolve_module_instance() -> None:
    """A module instance is refused, suggesting its class."""
    message = (
        "cannot use a Linear module as a wrap policy; to make every Linear a unit, pass its "
        "class: {Linear}"
    )
    with pytest.raises(WrapPlanError, match=f"^{re.escape(message)}$"):
        resolve_wrap_policy(nn.Linear(2, 2))


def test_resolve_callable_of_the_module_alone() -> None:
    """A callable that cannot take PyTorch's arguments is refused, pointing to CustomPolicy."""

    def is_block(m: nn.Module) -> bool:
        return isinstance(m, Block)

    message = (
        f"wrap policy {is_block!r} is callable but does not take PyTorch's auto-wrap arguments "
        "(module, recurse, nonwrapped_numel): missing a required argument: 'm'; for a function "
        "of the module alone, pass CustomPolicy(fn)"
    )
    with pytest.raises(WrapPlanError, match=f"^{re.escape(message)}$"):
        resolve_wrap_policy(is_block)


def test_resolve_non_class_in_a_set() -> None:
    """A collection holding something other than module classes gets ModuleWrapPolicy's error."""
    message = (
        "ModuleWrapPolicy: module_classes must hold nn.Module subclasses, got 'Block' (str); "
        "pass the class itself, e.g. module_classes={TransformerBlock}"
    )
    with pytest.raises(WrapPlanError, match=f"^{re.escape(message)}$"):
        resolve_wrap_policy(["Block"])  # type: ignore[list-item]


# ---------------------------------------------------------------------- tie folding


def _plan(root: nn.Module, policy: WrapPolicy, **kwargs: Any) -> list[tuple[str, int]]:
    return [(t.name, t.numel) for t in plan_units(root, policy, **kwargs)]


def _fold_records(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "shard.runtime"]


def test_tied_embedding_and_head_in_the_root_is_not_folded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A transformer policy leaves embedding and head in the root: the plan is plan_wraps'."""
    caplog.set_level(logging.DEBUG, logger="shard.runtime")
    model = GPT(tied=True)
    policy = ModuleWrapPolicy(Block)
    assert _plan(model, policy) == [(b, 88) for b in BLOCKS] + [("", 120)]
    assert plan_units(model, policy) == plan_wraps(model, policy)
    assert _fold_records(caplog) == []


def test_tie_between_separately_wrapped_embedding_and_head_lands_in_root(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Embedding and head wrapped on their own are both dropped: the tie ends up in the root."""
    caplog.set_level(logging.DEBUG, logger="shard.runtime")
    policy = NamePolicy(["embed", "head", *BLOCKS])
    model = GPT(tied=True)
    assert [t.name for t in plan_wraps(model, policy)] == ["embed", *BLOCKS, "head", ""]
    assert _plan(model, policy) == [(b, 88) for b in BLOCKS] + [("", 120)]
    assert _fold_records(caplog) == [
        "tied parameters 'embed.weight', 'head.weight' would be split across units 'embed', "
        "'head'; dropped units 'embed', 'head' so that unit '' holds them all"
    ]


def test_tie_between_a_unit_and_its_parent_drops_the_unit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Only the embedding wrapped: the head's use in the root pulls the embedding into the root."""
    caplog.set_level(logging.DEBUG, logger="shard.runtime")
    assert _plan(GPT(tied=True), NamePolicy(["embed", *BLOCKS])) == [(b, 88) for b in BLOCKS] + [
        ("", 120)
    ]
    assert _fold_records(caplog) == [
        "tied parameters 'embed.weight', 'head.weight' would be split across units 'embed', "
        "''; dropped units 'embed' so that unit '' holds them all"
    ]


def _tie_blocks(model: Staged, how: str) -> None:
    first, second = model.stage.blocks[0], model.stage.blocks[1]
    assert isinstance(first, Block)
    assert isinstance(second, Block)
    if how == "same-parameter":
        second.proj.weight = first.proj.weight
    elif how == "same-storage":
        second.proj.weight = nn.Parameter(first.proj.weight.detach())
    else:
        second.proj = first.proj


@pytest.mark.parametrize(
    ("how", "stage_numel", "names"),
    [
        ("same-parameter", 88 + 24, "'stage.blocks.0.proj.weight', 'stage.blocks.1.proj.weight'"),
        ("same-storage", 88 + 88, "'stage.blocks.0.proj.weight', 'stage.blocks.1.proj.weight'"),
        ("same-module", 88 + 16, "'stage.blocks.0.proj.weight', 'stage.blocks.1.proj.weight'"),
    ],
)
def test_tie_between_two_blocks_folds_into_their_parent(
    caplog: pytest.LogCaptureFixture, how: str, stage_numel: int, names: str
) -> None:
    """Blocks sharing a weight (one object, shared storage, or one module) fold into their stage."""
    caplog.set_level(logging.DEBUG, logger="shard.runtime")
    model = Staged()
    _tie_blocks(model, how)
    policy = NamePolicy(["stage", "stage.blocks.0", "stage.blocks.1", "stage.blocks.2", "tail"])
    assert _plan(model, policy) == [
        ("stage.blocks.2", 88),
        ("stage", stage_numel),
        ("tail", 88),
        ("", 0),
    ]
    assert _fold_records(caplog) == [
        f"tied parameters {names} would be split across units 'stage.blocks.0', "
        "'stage.blocks.1'; dropped units 'stage.blocks.0', 'stage.blocks.1' so that unit "
        "'stage' holds them all"
    ]


def test_tie_across_branches_drops_the_units_in_between(caplog: pytest.LogCaptureFixture) -> None:
    """A tie between a block in the stage and the tail drops the stage too: the root holds it."""
    caplog.set_level(logging.DEBUG, logger="shard.runtime")
    model = Staged()
    first = model.stage.blocks[0]
    assert isinstance(first, Block)
    model.tail.proj.weight = first.proj.weight
    policy = NamePolicy(["stage", "stage.blocks.0", "stage.blocks.1", "tail"])
    assert _plan(model, policy) == [("stage.blocks.1", 88), ("", 88 + 88 + 24)]
    assert _fold_records(caplog) == [
        "tied parameters 'stage.blocks.0.proj.weight', 'tail.proj.weight' would be split across "
        "units 'stage.blocks.0', 'tail'; dropped units 'stage.blocks.0', 'stage', 'tail' so that "
        "unit '' holds them all"
    ]


def test_untied_models_are_unchanged(caplog: pytest.LogCaptureFixture) -> None:
    """Without ties (on the CPU, or on meta where every storage sits at 0) nothing is folded."""
    caplog.set_level(logging.DEBUG, logger="shard.runtime")
    policy = NamePolicy(["embed", "head", *BLOCKS])
    for model in (GPT(tied=False), GPT(tied=False).to("meta"), Staged().to("meta")):
        assert plan_units(model, policy) == plan_wraps(model, policy)
    assert _plan(GPT(tied=False), policy) == [
        ("embed", 104),
        *[(b, 88) for b in BLOCKS],
        ("head", 104),
        ("", 16),
    ]
    assert _fold_records(caplog) == []


def test_ignored_tied_parameter_is_not_folded() -> None:
    """A tied parameter that is ignored is never sharded, so it splits nothing."""
    model = GPT(tied=True)
    policy = NamePolicy(["embed", "head", *BLOCKS])
    plan = _plan(model, policy, ignored_params=[model.embed.weight])
    assert plan == [("embed", 0), *[(b, 88) for b in BLOCKS], ("head", 0), ("", 16)]


def test_ignored_module_holding_a_tie_is_not_folded() -> None:
    """A tie whose other side sits in an ignored module leaves the units as planned."""
    model = GPT(tied=True)
    plan = _plan(model, NamePolicy(["embed", *BLOCKS]), ignored_modules=[model.head])
    # The head's weight is the embedding's: ignoring the head ignores it everywhere.
    assert plan == [("embed", 0), *[(b, 88) for b in BLOCKS], ("", 16)]


# ---------------------------------------------------------------------- apply_wrap_policy

# fully_shard's keyword arguments, in its signature's order (the messages list them).
FULLY_SHARD_KWARGS = ", ".join(
    p.name
    for p in inspect.signature(fully_shard).parameters.values()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
)


def test_apply_refuses_unknown_overrides_before_sharding() -> None:
    """Overrides naming no fully_shard argument are refused before any module is sharded."""
    model = GPT(tied=False)
    policy = CustomPolicy(lambda m: {"resharding": False} if isinstance(m, Block) else False)
    message = (
        "wrap policy answered overrides {'resharding': False} for module 'blocks.0' (Block), but "
        f"fully_shard does not take resharding; overrides may name {FULLY_SHARD_KWARGS}"
    )
    with pytest.raises(WrapPlanError, match=f"^{re.escape(message)}$"):
        apply_wrap_policy(model, policy)
    assert not any(isinstance(m, FSDPModule) for m in model.modules())


def test_apply_refuses_unknown_keyword_arguments() -> None:
    """A keyword argument fully_shard does not take is a TypeError listing the ones it takes."""
    message = (
        "apply_wrap_policy() got keyword arguments fully_shard does not take: mseh; it takes "
        f"{FULLY_SHARD_KWARGS}"
    )
    assert FULLY_SHARD_KWARGS.startswith("mesh, reshard_after_forward, ")
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        apply_wrap_policy(GPT(tied=False), Block, mseh=None)


STEPS, BATCH = 3, 2


def _build(tied: bool) -> GPT:
    torch.manual_seed(0)
    return GPT(tied=tied)


def _make_one(g: torch.Generator, batch: int) -> Batch:
    return (
        torch.randint(0, VOCAB, (batch, SEQ), generator=g),
        torch.randint(0, VOCAB, (batch, SEQ), generator=g),
    )


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def _optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05)


def _policy(kind: str, model: GPT) -> Any:
    if kind == "transformer":
        return "transformer"
    if kind == "custom":
        return CustomPolicy(
            lambda m: (
                {"reshard_after_forward": False} if m is model.blocks[1] else isinstance(m, Block)
            )
        )
    return NamePolicy(["embed", "head", *BLOCKS])


def _train_applied(
    tied: bool, kind: str
) -> tuple[list[str], dict[str, object], torch.Tensor, dict[str, torch.Tensor]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _build(tied)
    apply_wrap_policy(model, _policy(kind, model), mesh=init_device_mesh("cpu", (world,)))
    sharded = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    reshard: dict[str, object] = {
        name: unit_state.unit.reshard_after_forward
        for name, m in model.named_modules()
        if (unit_state := get_state(m)) is not None
    }
    optimizer = _optimizer(model.parameters())
    losses = []
    for step in make_batches(0, STEPS, world, BATCH, _make_one):
        tokens, target = step[rank]
        optimizer.zero_grad()
        loss = _loss(model(tokens), target)
        loss.backward()
        optimizer.step()
        total = loss.detach()
        dist.all_reduce(total)
        losses.append(total / world)
    state = {
        k: v.full_tensor() if isinstance(v, DTensor) else v.detach()
        for k, v in model.state_dict().items()
    }
    return sharded, reshard, torch.stack(losses), state


def _check_parity(results: list[Any], tied: bool) -> None:
    ref = train_reference(
        model_factory=lambda: _build(tied),
        optimizer_factory=_optimizer,
        loss_fn=_loss,
        batches=make_batches(0, STEPS, 2, BATCH, _make_one),
    )
    for _, _, losses, state in results:
        torch.testing.assert_close(losses, ref.losses)
        assert_state_dicts_equal(state, ref.state_dict)


def test_apply_transformer_policy_by_name(rank_pool: RankPool) -> None:
    """apply_wrap_policy(model, "transformer") shards blocks and root, training like one process."""
    results = rank_pool.run(_train_applied, 2, True, "transformer")
    for sharded, reshard, _, _ in results:
        assert sharded == ["", *BLOCKS]
        # None: fully_shard's default, decided at the first forward (False for the root).
        assert reshard == {"": None, "blocks.0": None, "blocks.1": None, "blocks.2": None}
    _check_parity(results, tied=True)


def test_apply_custom_policy_overrides_reach_their_unit(rank_pool: RankPool) -> None:
    """A CustomPolicy's {"reshard_after_forward": False} reaches that block only; parity holds."""
    results = rank_pool.run(_train_applied, 2, False, "custom")
    for sharded, reshard, _, _ in results:
        assert sharded == ["", *BLOCKS]
        assert reshard == {"": None, "blocks.0": None, "blocks.1": False, "blocks.2": None}
    _check_parity(results, tied=False)


def test_apply_policy_splitting_a_tie_trains_like_one_process(rank_pool: RankPool) -> None:
    """A policy wrapping a tied embedding and head apart is folded, and the model trains exactly."""
    results = rank_pool.run(_train_applied, 2, True, "split")
    for sharded, _, _, _ in results:
        assert sharded == ["", *BLOCKS]
    _check_parity(results, tied=True)
