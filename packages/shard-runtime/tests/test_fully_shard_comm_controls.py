"""FSDPModule's communication controls change what they promise and train like one process.

Each worker builds the same small model on every rank, shards it, sets some
controls, runs one backward on its own batch and returns its full gradients
(``full_tensor()``) next to a one-process reference computed from every
rank's batch, plus the counters the control should move.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shard_comms import count_collectives, get_device_handle
from shard_runtime import FSDPModule, fully_shard, share_comm_ctx
from shard_runtime._comm import CommContext, InFlight
from shard_runtime._state import get_state
from shard_testing import RankPool
from shard_testing.compat import BranchNet, CountingAllGather, CountingReduceScatter
from shard_testing.compat import error as _error
from shard_testing.models import data_parallel_mesh

Grads = dict[str, list[float]]


class _Net(BranchNet):
    """BranchNet under the name the messages checked here spell (``fully_shard(_Net)``)."""


def _batch(rank: int) -> torch.Tensor:
    torch.manual_seed(100 + rank)
    return torch.randint(0, 10, (6,))


def _loss(model: nn.Module, x: torch.Tensor, use_side: bool = True) -> torch.Tensor:
    out, side = model(x)
    loss = out.square().sum()
    return loss + side.sum() if use_side else loss


def _sharded(hsdp: bool = False) -> tuple[_Net, Any]:
    """The model sharded bottom-up (emb, l1, side, then the root holding l2)."""
    torch.manual_seed(0)
    model = _Net()
    mesh = data_parallel_mesh(hybrid=hsdp)
    for child in (model.emb, model.l1, model.side):
        fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, model


def _reference(world: int) -> Grads:
    """One process's gradients of every rank's batch, averaged over the ``world`` ranks."""
    torch.manual_seed(0)
    model = _Net()
    for rank in range(world):
        _loss(model, _batch(rank)).backward()
    return {n: (p.grad / world).flatten().tolist() for n, p in model.named_parameters()}


def _full_grads(model: nn.Module) -> dict[str, list[float] | None]:
    return {
        n: None if p.grad is None else p.grad.full_tensor().flatten().tolist()
        for n, p in model.named_parameters()
    }


def _close(got: dict[str, Any], want: Grads, scale: dict[str, float] | None = None) -> None:
    assert list(got) == list(want)
    for name, values in want.items():
        factor = (scale or {}).get(name.split(".")[0], 1.0)
        expected = torch.tensor(values) * factor
        torch.testing.assert_close(
            torch.tensor(got[name]), expected, msg=lambda m, n=name: f"{n}: {m}"
        )


# ---------------------------------------------------------------------- divide factors


def _divide_factor(hsdp: bool) -> dict[str, Any]:
    model, root = _sharded(hsdp)
    root.set_gradient_divide_factor(3.0)  # the root's unit: l2
    model.l1.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.side.set_reduce_scatter_divide_factor(5.0)  # type: ignore[operator]
    _loss(model, _batch(dist.get_rank())).backward()
    return {
        "grads": _full_grads(model),
        "deprecation": [(w.category.__name__, str(w.message)) for w in caught],
        "bad": [_error(lambda v=v: root.set_gradient_divide_factor(v)) for v in (0.0, -2.0)],
    }


@pytest.mark.parametrize(("world", "hsdp"), [(2, False), (4, True)])
def test_gradient_divide_factor_and_force_sum(rank_pool: RankPool, world: int, hsdp: bool) -> None:
    """A unit's divide factor replaces the data-parallel size (also across replicas of a 2x2
    mesh); force-sum still averages; the deprecated alias warns and acts the same."""
    results = rank_pool.run(_divide_factor, world, hsdp)
    # Reference averaged over every rank, rescaled per unit to its divisor.
    average = _reference(world)
    scale = {"l2": world / 3.0, "side": world / 5.0}
    for result in results:
        _close(result["grads"], average, scale)
        assert result["deprecation"] == [
            ("DeprecationWarning", "Use `set_gradient_divide_factor` instead")
        ]
        for bad, value in zip(result["bad"], ("0.0", "-2.0"), strict=True):
            assert bad.startswith("ValueError: set_gradient_divide_factor(_Net): factor must be")
            assert f"got {value}" in bad


# ---------------------------------------------------------------------- all-reduce hook


def _all_reduce_hook(hsdp: bool) -> dict[str, Any]:
    model, root = _sharded(hsdp)
    seen: list[list[float]] = []

    def hook(output: torch.Tensor) -> None:
        seen.append(output.tolist())
        output.mul_(10.0)

    root.set_all_reduce_hook(hook)
    with count_collectives() as counts:
        _loss(model, _batch(dist.get_rank())).backward()
    l2_local = [p.grad.to_local().flatten().tolist() for p in model.l2.parameters()]
    stream = get_device_handle("cpu").new_stream()  # the CPU's no-op stream
    stream_error = _error(lambda: model.l1.set_all_reduce_hook(hook, stream=stream))  # type: ignore[operator]
    return {
        "grads": _full_grads(model),
        "seen": seen,
        "l2_local": l2_local,
        "all_reduces": counts.calls("all_reduce"),
        "stream_error": stream_error,
    }


@pytest.mark.parametrize(("world", "hsdp"), [(2, False), (4, True)])
def test_all_reduce_hook(rank_pool: RankPool, world: int, hsdp: bool) -> None:
    """The hook sees the unit's averaged gradient shard once per backward (after the replica
    all-reduce on a 2x2 mesh) and its in-place change is what the parameters keep."""
    results = rank_pool.run(_all_reduce_hook, world, hsdp)
    reference = _reference(world)
    for result in results:
        _close(result["grads"], reference, {"l2": 10.0})
        assert len(result["seen"]) == 1
        # What the hook saw is the rank's local shard before the x10: weight rows, then bias.
        seen = torch.tensor(result["seen"][0])
        kept = torch.tensor([v for part in result["l2_local"] for v in part])
        torch.testing.assert_close(seen * 10.0, kept)
        assert result["all_reduces"] == (4 if hsdp else 0)  # one per unit across replicas
    if hsdp:
        assert results[0]["stream_error"].startswith(
            "ValueError: set_all_reduce_hook(l1): stream cannot be set when using native HSDP"
        )
    else:
        assert results[0]["stream_error"] == "no error"


# ---------------------------------------------------------------------- unshard_in_backward


def _unshard_in_backward() -> dict[str, Any]:
    model, _ = _sharded()
    model.emb.set_unshard_in_backward(False)  # type: ignore[operator]
    with count_collectives() as counts:
        for _ in range(2):
            _loss(model, _batch(dist.get_rank())).backward()
    return {
        "grads": _full_grads(model),
        "emb_gathers": counts.calls("all_gather", "emb"),
        "l1_gathers": counts.calls("all_gather", "l1"),
        "emb_reduces": counts.calls("reduce_scatter", "emb"),
    }


def test_unshard_in_backward_false_skips_the_backward_all_gather(rank_pool: RankPool) -> None:
    """An embedding unit set to not unshard in backward gathers once per step, not twice, and
    its gradients still reach every rank's shard exactly."""
    results = rank_pool.run(_unshard_in_backward, 2)
    reference = _reference(2)
    for result in results:
        _close(result["grads"], {k: [2 * v for v in vs] for k, vs in reference.items()})
        assert result["emb_gathers"] == 2  # forward only, two steps
        assert result["l1_gathers"] == 4  # forward and backward
        assert result["emb_reduces"] == 2


# ---------------------------------------------------------------------- unused params


def _unused_params(enable: bool) -> dict[str, Any]:
    model, root = _sharded()
    root.set_reduce_scatter_unused_params(enable)
    with count_collectives() as counts:
        _loss(model, _batch(dist.get_rank()), use_side=False).backward()
    return {
        "side": [
            None if p.grad is None else p.grad.to_local().tolist() for p in model.side.parameters()
        ],
        "side_reduces": counts.calls("reduce_scatter", "side"),
        "flags": [
            get_state(m).unit.reduce_scatter_unused_params for m in model.modules() if get_state(m)
        ],  # type: ignore[union-attr]
    }


def test_reduce_scatter_unused_params(rank_pool: RankPool) -> None:
    """A unit no loss reaches keeps grad None by default; with the flag (set recursively) every
    rank reduce-scatters zeros for it and its parameters get zero gradients."""
    off = rank_pool.run(_unused_params, 2, False)[0]
    on = rank_pool.run(_unused_params, 2, True)[0]
    assert off["side"] == [None, None]
    assert off["side_reduces"] == 0
    assert on["side"] == [[[0.0] * 4] * 2, [0.0] * 2]
    assert on["side_reduces"] == 1
    assert on["flags"] == [True] * 4


# ---------------------------------------------------------------------- reductions in flight


class _PeakContext(CommContext):
    """Remembers the most reductions it ever had in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0

    def queue(self, pending: Sequence[InFlight], limit: int) -> None:
        super().queue(pending, limit)
        self.peak = max(self.peak, len(self.in_flight))


def _max_input_buffers() -> dict[str, Any]:
    model, root = _sharded()
    errors = [
        _error(lambda v=v: root.set_reduce_scatter_max_input_buffers(v)) for v in (True, 1.5, 0)
    ]
    default = _PeakContext()
    get_state(model).unit.comm_ctx = default  # type: ignore[union-attr]  # the root's is used
    _loss(model, _batch(dist.get_rank())).backward()
    model.zero_grad()
    root.set_reduce_scatter_max_input_buffers(3)
    ctx = _PeakContext()
    get_state(model).unit.comm_ctx = ctx  # type: ignore[union-attr]
    _loss(model, _batch(dist.get_rank())).backward()
    return {
        "grads": _full_grads(model),
        "errors": errors,
        "peak": (default.peak, ctx.peak),
        "left": len(ctx.in_flight),
    }


def test_reduce_scatter_max_input_buffers(rank_pool: RankPool) -> None:
    """With a cap of 3 the backward keeps three reductions in flight (one by default), drains
    them all at its end, and the gradients stay exact; a bool, float or 0 is refused."""
    results = rank_pool.run(_max_input_buffers, 2)
    reference = _reference(2)
    for result in results:
        _close(result["grads"], reference)
        assert result["peak"] == (1, 3)
        assert result["left"] == 0
        assert result["errors"][0].startswith(
            "TypeError: set_reduce_scatter_max_input_buffers(_Net): max_input_buffers must be "
            "an int, got bool"
        )
        assert result["errors"][1].endswith("must be an int, got float")
        assert result["errors"][2].startswith(
            "ValueError: set_reduce_scatter_max_input_buffers(_Net): max_input_buffers must be a "
            "positive int, got 0"
        )


# ---------------------------------------------------------------------- separate group


def _separate_group(hsdp: bool) -> dict[str, Any]:
    model, root = _sharded(hsdp)
    root.set_separate_reduce_scatter_group()
    units = [get_state(m).unit for m in (model, model.emb, model.l1, model.side)]  # type: ignore[union-attr]
    groups = {id(u.reduce_scatter_group) for u in units}
    ranks = [dist.get_process_group_ranks(u.reduce_scatter_group) for u in units[:1]]  # type: ignore[arg-type]
    shard_ranks = dist.get_process_group_ranks(units[0].shard_group)
    distinct = all(u.reduce_scatter_group is not u.shard_group for u in units)
    _loss(model, _batch(dist.get_rank())).backward()
    grads = _full_grads(model)
    model.l1.set_separate_reduce_scatter_group(False, recurse=False)  # type: ignore[operator]
    return {
        "grads": grads,
        "one_group": len(groups) == 1,
        "distinct": distinct,
        "same_ranks": ranks == [shard_ranks],
        "reset": [u.reduce_scatter_group is None for u in units],
    }


@pytest.mark.parametrize(("world", "hsdp"), [(2, False), (4, True)])
def test_separate_reduce_scatter_group(rank_pool: RankPool, world: int, hsdp: bool) -> None:
    """Every unit reduce-scatters over one new group with the shard ranks, gradients unchanged;
    False (here on one unit, not recursing) goes back to the shard group."""
    for result in rank_pool.run(_separate_group, world, hsdp):
        _close(result["grads"], _reference(world))
        assert result["one_group"] is True
        assert result["distinct"] is True
        assert result["same_ranks"] is True
        assert result["reset"] == [False, False, True, False]


# ---------------------------------------------------------------------- custom collectives


class _WrongSize(CountingAllGather):
    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(1, dtype=dtype, device=device)


def _custom_comms(hsdp: bool) -> dict[str, Any]:
    model, _ = _sharded(hsdp)
    gather, scatter = CountingAllGather(), CountingReduceScatter()
    model.l1.set_custom_all_gather(gather)  # type: ignore[operator]
    model.l1.set_custom_reduce_scatter(scatter)  # type: ignore[operator]
    with count_collectives() as counts:
        _loss(model, _batch(dist.get_rank())).backward()
    grads = _full_grads(model)
    conflicts = [
        _error(lambda: model.l1.set_allocate_memory_from_process_group_for_comm(True)),  # type: ignore[operator]
        _error(lambda: model.l1.set_symm_mem_for_comm()),  # type: ignore[operator]
    ]
    model.emb.set_custom_all_gather(_WrongSize())  # type: ignore[operator]
    wrong = _error(lambda: model(_batch(0)))
    return {
        "grads": grads,
        "gather": (gather.calls, gather.allocations),
        "scatter": (scatter.calls, scatter.allocations, scatter.ops),
        "counted": (counts.calls("all_gather", "l1"), counts.calls("reduce_scatter", "l1")),
        "conflicts": conflicts,
        "wrong": wrong,
    }


@pytest.mark.parametrize(("world", "hsdp"), [(2, False), (4, True)])
def test_custom_all_gather_and_reduce_scatter(rank_pool: RankPool, world: int, hsdp: bool) -> None:
    """A unit's custom all-gather and reduce-scatter are called for its collectives (and counted
    like shard's own), buffers come from their allocate, and the gradients stay exact."""
    shard = world // 2 if hsdp else world
    # l1: weight 8x4 + bias 8, padded per rank: (8 / shard) rows of 4, plus 8 / shard.
    per_rank = 8 // shard * 4 + 8 // shard
    for result in rank_pool.run(_custom_comms, world, hsdp):
        _close(result["grads"], _reference(world))
        assert result["gather"] == (2, [(shard * per_rank,)] * 2)  # forward and backward
        assert result["scatter"] == (
            1,
            [(per_rank,), (shard * per_rank,)],
            ["RedOpType.SUM"],
        )
        assert result["counted"] == (2, 1)
        for conflict in result["conflicts"]:
            assert conflict.startswith("AssertionError: set_")
            assert "cannot be used with the custom communication CountingAllGather" in conflict
        assert result["wrong"].startswith(
            "CommError: _WrongSize.allocate returned a tensor of 1 elements for the all-gather "
            "output of"
        )


# ---------------------------------------------------------------------- allocators, sharing


def _allocators_and_sharing() -> dict[str, Any]:
    model, root = _sharded()
    root.set_allocate_memory_from_process_group_for_comm(True)
    model.l1.set_symm_mem_for_comm()  # type: ignore[operator]
    bad_backend = _error(lambda: model.l1.set_symm_mem_for_comm("GLOO"))  # type: ignore[operator]
    second, _ = _sharded()
    share_comm_ctx([model, second])  # type: ignore[list-item]
    share_comm_ctx([])
    shared = {
        id(get_state(m).unit.comm_ctx)  # type: ignore[union-attr]
        for top in (model, second)
        for m in top.modules()
        if get_state(m) is not None
    }
    not_sharded = _error(lambda: share_comm_ctx([model, nn.Linear(2, 2)]))  # type: ignore[list-item]
    for net in (model, second):
        _loss(net, _batch(dist.get_rank())).backward()
    return {
        "grads": [_full_grads(model), _full_grads(second)],
        "bad_backend": bad_backend,
        "shared": len(shared),
        "not_sharded": not_sharded,
        "is_fsdp": isinstance(second, FSDPModule),
    }


def test_allocators_on_cpu_and_share_comm_ctx(rank_pool: RankPool) -> None:
    """Process-group and symmetric-memory allocation change nothing on gloo; share_comm_ctx
    gives two roots one context (they still train exactly) and refuses unsharded modules."""
    result = rank_pool.run(_allocators_and_sharing, 2)[0]
    reference = _reference(2)
    for grads in result["grads"]:
        _close(grads, reference)
    assert result["bad_backend"].startswith(
        "ValueError: set_symm_mem_for_comm(l1): backend must be 'NCCL'"
    )
    assert result["shared"] == 1
    assert result["not_sharded"].startswith(
        "ValueError: share_comm_ctx: expects a list of FSDPModules (modules fully_shard was "
        "applied to) but got Linear"
    )
    assert result["is_fsdp"] is True
