"""FullyShardedDataParallel's communication: collectives per iteration per strategy, comm hooks.

Counts come from shard-comms' counters around the forward and the backward
of a ToyNet wrapped per block (three blocks and the root: four units), for
two iterations. Collectives over a group of one rank are local copies and
are not counted, which is what makes NO_SHARD (a replica axis of N and a
shard axis of 1) show all-reduces only.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from shard_comms import count_collectives
from shard_core.protocols import GradReducer
from shard_runtime import (
    FullyShardedDataParallel,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
)
from shard_runtime.plumbing import clean_fqn
from shard_testing import RankPool
from shard_testing.models import ResidualBlock, ToyNet, toy_batches

FSDP = FullyShardedDataParallel
PER_BLOCK = ModuleWrapPolicy({ResidualBlock})
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
UNITS = ["ToyNet", "blocks.0", "blocks.1", "blocks.2"]
S = ShardingStrategy


def _count(strategy: ShardingStrategy, hybrid: bool) -> list[dict[str, Any]]:
    world = dist.get_world_size()
    kwargs: dict[str, Any] = {}
    if hybrid:
        kwargs["device_mesh"] = init_device_mesh(
            "cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")
        )
    model = FSDP(ToyNet(), sharding_strategy=strategy, auto_wrap_policy=PER_BLOCK, **kwargs)
    x = torch.randn(4, 6)
    iterations = []
    for _ in range(2):
        with count_collectives() as forward:
            loss = model(x).sum()
        with count_collectives() as backward:
            loss.backward()
        iterations.append(
            {
                "forward": {k: forward.calls(k) for k in KINDS},
                "backward": {k: backward.calls(k) for k in KINDS},
                "forward_labels": sorted(forward.labels()),
                "backward_labels": sorted(backward.labels()),
            }
        )
    return iterations


def _calls(all_gather: int = 0, reduce_scatter: int = 0, all_reduce: int = 0) -> dict[str, int]:
    return {
        "all_gather": all_gather,
        "reduce_scatter": reduce_scatter,
        "all_reduce": all_reduce,
        "broadcast": 0,
    }


@pytest.mark.parametrize(
    ("strategy", "world", "hybrid", "forward", "backward"),
    [
        pytest.param(S.FULL_SHARD, 2, False, _calls(4), _calls(3, 4), id="FULL_SHARD"),
        pytest.param(S.SHARD_GRAD_OP, 2, False, _calls(4), _calls(0, 4), id="SHARD_GRAD_OP"),
        pytest.param(S.NO_SHARD, 2, False, _calls(), _calls(0, 0, 4), id="NO_SHARD"),
        pytest.param(S.HYBRID_SHARD, 4, True, _calls(4), _calls(3, 4, 4), id="HYBRID_SHARD"),
        pytest.param(
            S._HYBRID_SHARD_ZERO2, 4, True, _calls(4), _calls(0, 4, 4), id="_HYBRID_SHARD_ZERO2"
        ),
    ],
)
def test_collectives_per_iteration(
    rank_pool: RankPool,
    strategy: ShardingStrategy,
    world: int,
    hybrid: bool,
    forward: dict[str, int],
    backward: dict[str, int],
) -> None:
    """Each strategy issues its documented collectives, one per unit, every iteration.

    FULL_SHARD gathers the 4 units in forward and the 3 blocks again in
    backward (the root keeps its parameters), then reduce-scatters 4 times;
    SHARD_GRAD_OP keeps every unit gathered; NO_SHARD all-reduces 4 times and
    nothing else; the hybrid strategies add one all-reduce per unit across
    the 2 replicas of a 2x2 mesh.
    """
    for iterations in rank_pool.run(_count, world, strategy, hybrid):
        for iteration in iterations:
            assert iteration["forward"] == forward
            assert iteration["backward"] == backward
            assert iteration["forward_labels"] == (UNITS if forward["all_gather"] else [])
            assert iteration["backward_labels"] == UNITS


# ---------------------------------------------------------------------- comm hooks


class CountingHook:
    """A comm hook that reduces as the default does and counts its calls per unit size."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(
        self, reducer: GradReducer, grad: torch.Tensor, output: torch.Tensor | None
    ) -> None:
        self.calls.append(grad.numel())
        reducer.reduce(grad, output)


def _grads(hook: object, mixed_precision: MixedPrecision | None = None) -> dict[str, Any]:
    """Flat gradients after one backward on this rank's batch, with ``hook`` registered."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = FSDP(ToyNet(), auto_wrap_policy=PER_BLOCK, mixed_precision=mixed_precision)
    if isinstance(hook, tuple):
        model.register_comm_hook(*hook)
    elif hook is not None:
        model.register_comm_hook(hook)
    x, y = toy_batches(world, 1)[0][0][rank]
    nn.functional.mse_loss(model(x), y).backward()
    grads = {
        clean_fqn(n): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }
    calls_after_one = list(hook.calls) if isinstance(hook, CountingHook) else []
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    return {
        "grads": grads,
        "dtypes": sorted({str(g.dtype) for g in grads.values()}),
        "calls_after_one": calls_after_one,
        "calls_after_two": list(hook.calls) if isinstance(hook, CountingHook) else [],
    }


def _hooks() -> dict[str, Any]:
    counting = CountingHook()
    return {
        "default": _grads(None),
        "bf16_by_name": _grads("bf16_compress"),
        "bf16_torch_form": _grads((None, "bf16_compress")),
        "bf16_reduce_dtype": _grads(None, MixedPrecision(reduce_dtype=torch.bfloat16)),
        "counting": _grads(counting),
    }


@pytest.fixture(scope="module")
def hooks(rank_pool: RankPool) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = rank_pool.run(_hooks, 2)
    return results


FLAT_NAMES = ["_flat_param", "blocks.0._flat_param", "blocks.1._flat_param", "blocks.2._flat_param"]


def test_bf16_compress_hook_by_name_reduces_in_bf16(hooks: list[dict[str, Any]]) -> None:
    """'bf16_compress' from the registry gives the gradients of a bf16 reduction, kept in fp32."""
    for result in hooks:
        by_name = result["bf16_by_name"]
        assert list(by_name["grads"]) == FLAT_NAMES
        assert by_name["dtypes"] == ["torch.float32"]
        for name in FLAT_NAMES:
            bf16 = by_name["grads"][name]
            direct = result["bf16_reduce_dtype"]["grads"][name]
            fp32 = result["default"]["grads"][name]
            torch.testing.assert_close(bf16, direct, rtol=1e-2, atol=1e-3)
            torch.testing.assert_close(bf16, fp32, rtol=1e-2, atol=1e-2)
            assert not torch.equal(bf16, fp32)
            torch.testing.assert_close(
                result["bf16_torch_form"]["grads"][name], bf16, rtol=0, atol=0
            )


def test_custom_hook_is_called_once_per_unit_per_backward(hooks: list[dict[str, Any]]) -> None:
    """A callable hook runs once for each of the 4 units per backward and replaces the default."""
    for result in hooks:
        counting = result["counting"]
        # Full flat gradient sizes: each block 2 x 226, the root 2 x 52, in backward order.
        assert counting["calls_after_one"] == [452, 452, 452, 104]
        assert counting["calls_after_two"] == [452, 452, 452, 104] * 2
        for name in FLAT_NAMES:
            torch.testing.assert_close(
                counting["grads"][name], result["default"]["grads"][name], rtol=0, atol=0
            )


def _hook_errors() -> dict[str, str]:
    model = FSDP(ToyNet(), auto_wrap_policy=PER_BLOCK)
    out = {}
    for key, hook in [("number", 3), ("unknown", "no_such_hook")]:
        try:
            model.register_comm_hook(hook)  # type: ignore[arg-type]
        except Exception as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
    return out


def test_register_comm_hook_rejects_non_hooks_and_unknown_names(rank_pool: RankPool) -> None:
    """A number is a TypeError; an unregistered name lists the registered ones."""
    for result in rank_pool.run(_hook_errors, 2):
        assert result["number"] == (
            "TypeError: register_comm_hook: expected a comm hook or a registered hook name, got int"
        )
        assert result["unknown"].startswith("UnknownPluginNameError: ")
        assert "'no_such_hook'" in result["unknown"]
        assert "bf16_compress" in result["unknown"]
