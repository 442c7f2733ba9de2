"""A comm hook replaces a unit's collectives and nothing else: the unit's one reduction path.

Each worker trains the same small model twice on its rank's micro-batches,
once without a comm hook and once with a hook on every unit, under one
communication control, and returns both runs' local gradient shards, the
collectives each run issued and what the hook saw. An identity hook (it
calls the reducer it is given) must change no bit of any gradient and no
collective; a bf16-compressing hook must stay within bf16 rounding.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from shard_comms import DefaultGradReducer, count_collectives, resolve_comm_hook
from shard_core.protocols import CommHook, GradReducer
from shard_runtime import FSDPModule, FullyShardedDataParallel, ShardingStrategy, fully_shard
from shard_runtime._state import states_in
from shard_runtime.plumbing import clean_fqn
from shard_testing import RankPool
from shard_testing.compat import CountingReduceScatter
from shard_testing.models import data_parallel_mesh, uneven_mlp

MICRO_BATCHES = 2
KINDS: tuple[Literal["reduce_scatter", "all_reduce"], ...] = ("reduce_scatter", "all_reduce")


class IdentityHook:
    """``reducer.reduce(grad, output)``, recording the reducer's group and sizes per call."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []  # (world_size, data_parallel_size)
        self.groups: list[dist.ProcessGroup | None] = []

    def __call__(
        self, reducer: GradReducer, grad: torch.Tensor, output: torch.Tensor | None
    ) -> None:
        self.seen.append((reducer.world_size, reducer.data_parallel_size))
        assert isinstance(reducer, DefaultGradReducer)
        self.groups.append(reducer.group)
        reducer.reduce(grad, output)


def _scale_by_three(shard: torch.Tensor) -> None:
    shard.mul_(3.0)


def _apply_control(model: nn.Sequential, control: str) -> dict[str, Any]:
    """Set ``control`` on the sharded model; returns what the run should report on it."""
    root: FSDPModule = model  # type: ignore[assignment]
    inner: FSDPModule = model[2]  # type: ignore[assignment]
    extra: dict[str, Any] = {}
    if control == "divide_factor":
        root.set_gradient_divide_factor(3.0)
        inner.set_gradient_divide_factor(5.0)
    elif control == "force_sum":
        root.set_force_sum_reduction_for_comms(True)
        inner.set_force_sum_reduction_for_comms(True)
        inner.set_gradient_divide_factor(5.0)
    elif control == "reduce_scatter_divide_factor":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            root.set_reduce_scatter_divide_factor(7.0)
    elif control == "all_reduce_hook":
        root.set_all_reduce_hook(_scale_by_three)
        inner.set_force_sum_reduction_for_comms(True)
        inner.set_all_reduce_hook(_scale_by_three)
    elif control == "separate_group":
        root.set_separate_reduce_scatter_group(True)
    elif control == "custom_reduce_scatter":
        comm = CountingReduceScatter()
        root.set_custom_reduce_scatter(comm)
        inner.set_custom_reduce_scatter(comm)
        extra["custom"] = comm
    elif control not in ("default", "deferred"):
        raise AssertionError(f"unknown control {control!r}")
    return extra


def _train(control: str, two_d: bool, hook: CommHook | None) -> dict[str, Any]:
    mesh = data_parallel_mesh(hybrid=two_d)
    model = uneven_mlp()
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    root: FSDPModule = model  # type: ignore[assignment]
    extra = _apply_control(model, control)
    states = states_in([model])
    if hook is not None:
        for state in states:
            state.unit.comm_hook = hook
    g = torch.Generator().manual_seed(7)
    world, rank = dist.get_world_size(), dist.get_rank()
    data = [torch.randn(4, 5, generator=g) for _ in range(MICRO_BATCHES * world)]
    with count_collectives() as counts:
        for micro in range(MICRO_BATCHES):
            if control == "deferred":
                root.set_requires_all_reduce(micro == MICRO_BATCHES - 1)
            model(data[MICRO_BATCHES * rank + micro]).square().sum().backward()
    grads = {n: _local_grad(p) for n, p in model.named_parameters()}
    custom = extra.get("custom")
    return {
        "grads": grads,
        "counts": {k: counts.calls(k) for k in KINDS},
        "custom_calls": None if custom is None else custom.calls,
        "rs_groups": [s.unit.reduce_scatter_group or s.unit.shard_group for s in states],
    }


def _local_grad(param: nn.Parameter) -> torch.Tensor:
    assert isinstance(param.grad, DTensor)
    return param.grad.to_local().clone()


def _identity_vs_none(control: str, two_d: bool) -> dict[str, Any]:
    plain = _train(control, two_d, None)
    hook = IdentityHook()
    hooked = _train(control, two_d, hook)
    return {
        "equal": {n: torch.equal(plain["grads"][n], g) for n, g in hooked["grads"].items()},
        "nonzero": all(bool(g.any()) for g in plain["grads"].values()),
        "counts": (plain["counts"], hooked["counts"]),
        "custom_calls": (plain["custom_calls"], hooked["custom_calls"]),
        "seen": hook.seen,
        "hook_groups_are_units": all(any(g is u for u in hooked["rs_groups"]) for g in hook.groups),
    }


CONTROLS_1D = [
    "default",
    "divide_factor",
    "force_sum",
    "reduce_scatter_divide_factor",
    "all_reduce_hook",
    "separate_group",
    "custom_reduce_scatter",
]
CONTROLS_2D = ["default", "divide_factor", "force_sum", "all_reduce_hook", "deferred"]


def _check_identity(results: list[dict[str, Any]], custom: bool) -> None:
    for result in results:
        assert result["nonzero"]
        assert result["equal"] == {n: True for n in result["equal"]}
        plain_counts, hooked_counts = result["counts"]
        assert hooked_counts == plain_counts
        assert result["hook_groups_are_units"]
        plain_custom, hooked_custom = result["custom_calls"]
        if custom:
            assert plain_custom == hooked_custom == 2 * MICRO_BATCHES  # 2 units per backward
        else:
            assert plain_custom is hooked_custom is None


@pytest.mark.parametrize("control", CONTROLS_1D)
def test_identity_hook_is_bitwise_the_default_path(rank_pool: RankPool, control: str) -> None:
    """On a 1-D mesh an identity hook gives bitwise the gradients and collectives of no hook."""
    results = rank_pool.run(_identity_vs_none, 2, control, False)
    _check_identity(results, custom=control == "custom_reduce_scatter")
    for result in results:
        assert result["seen"] == [(2, 2)] * (2 * MICRO_BATCHES)


@pytest.mark.parametrize("control", CONTROLS_2D)
def test_identity_hook_is_bitwise_the_default_path_on_2d(rank_pool: RankPool, control: str) -> None:
    """On a 2x2 (replicate x shard) mesh an identity hook changes no gradient bit and no
    collective; it is handed the replica all-reduce (data-parallel size 4) unless that is
    deferred or follows a deferral (then the reduce-scatter alone, size 2)."""
    results = rank_pool.run(_identity_vs_none, 4, control, True)
    _check_identity(results, custom=False)
    units = 2
    if control == "deferred":
        # Micro-batch 0 defers, micro-batch 1 adds the partial and then all-reduces.
        expected = [(2, 2)] * (units * MICRO_BATCHES)
    else:
        expected = [(2, 4)] * (units * MICRO_BATCHES)
    for result in results:
        assert result["seen"] == expected
        plain_counts, _ = result["counts"]
        all_reduces = units if control == "deferred" else units * MICRO_BATCHES
        assert plain_counts == {"reduce_scatter": units * MICRO_BATCHES, "all_reduce": all_reduces}


def _compressed_vs_none(control: str, two_d: bool) -> dict[str, Any]:
    plain = _train(control, two_d, None)
    hook = resolve_comm_hook("bf16_compress")
    compressed = _train(control, two_d, hook)
    return {"plain": plain["grads"], "compressed": compressed["grads"]}


@pytest.mark.parametrize(
    ("control", "world", "two_d"),
    [("default", 2, False), ("divide_factor", 2, False), ("deferred", 4, True)],
)
def test_bf16_compress_hook_matches_to_bf16_rounding(
    rank_pool: RankPool, control: str, world: int, two_d: bool
) -> None:
    """The registered 'bf16_compress' hook reduces in bf16 under each control: its gradients
    differ from the fp32 reduction's, by no more than bf16 rounding."""
    for result in rank_pool.run(_compressed_vs_none, world, control, two_d):
        plain, compressed = result["plain"], result["compressed"]
        assert list(compressed) == list(plain)
        assert any(not torch.equal(compressed[n], plain[n]) for n in plain)
        for name in plain:
            torch.testing.assert_close(compressed[name], plain[name], rtol=1e-2, atol=1e-2)


def _wrapper_hybrid(with_hook: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = FullyShardedDataParallel(
        uneven_mlp(),
        device_mesh=mesh,
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        auto_wrap_policy=_wrap_middle,
    )
    hook = IdentityHook()
    if with_hook:
        model.register_comm_hook(hook)
    g = torch.Generator().manual_seed(7)
    data = [torch.randn(4, 5, generator=g) for _ in range(4)]
    model(data[dist.get_rank()]).square().sum().backward()
    return {
        "grads": {
            clean_fqn(n): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
        },
        "seen": hook.seen,
    }


def _wrap_middle(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    return recurse or (isinstance(module, nn.Linear) and module.out_features == 6)


def test_wrapper_register_comm_hook_is_bitwise_the_default_under_hybrid_shard(
    rank_pool: RankPool,
) -> None:
    """The wrapper's register_comm_hook under HYBRID_SHARD: an identity hook receives the
    whole reduction (data-parallel size 4) and changes no gradient bit."""
    plain = rank_pool.run(_wrapper_hybrid, 4, False)
    hooked = rank_pool.run(_wrapper_hybrid, 4, True)
    for before, after in zip(plain, hooked, strict=True):
        assert list(after["grads"]) == ["_flat_param", "2._flat_param"]
        for name, grad in before["grads"].items():
            assert torch.equal(after["grads"][name], grad), name
        assert after["seen"] == [(2, 4), (2, 4)]
        assert before["seen"] == []
