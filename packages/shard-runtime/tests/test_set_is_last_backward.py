"""set_is_last_backward(False) leaves the last reductions in flight, and none is lost.

Each worker shards the same three-unit model on every rank, accumulates
gradients over three micro-batches of its own data (the first two with
``set_is_last_backward(False)`` unless the run never calls it), steps an
optimizer and returns its local gradient and parameter shards. A run that
defers must be bitwise the run that never calls it; PyTorch's own
``fully_shard`` doing the same gives the same values to float rounding.
"""

from __future__ import annotations

from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shard_runtime._state import UnitState, get_state, states_in
from shard_testing import RankPool
from shard_testing.compat import fsdp_namespace
from shard_testing.models import data_parallel_mesh, uneven_mlp

MICRO_BATCHES = 3
Impl = Literal["torch", "shard"]


def _sharded(impl: Impl, two_d: bool = False) -> nn.Sequential:
    """Units model[0], model[2] and the root (model[4])."""
    fully_shard = fsdp_namespace(impl).fully_shard
    mesh = data_parallel_mesh(hybrid=two_d)
    model = uneven_mlp()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    world, rank = dist.get_world_size(), dist.get_rank()
    batches = [torch.randn(4, 5, generator=g) for _ in range(MICRO_BATCHES * world)]
    return batches[MICRO_BATCHES * rank : MICRO_BATCHES * (rank + 1)]


def _local(tensor: torch.Tensor | None) -> torch.Tensor:
    assert isinstance(tensor, DTensor)
    return tensor.to_local().detach().clone()


def _full(tensor: torch.Tensor | None) -> torch.Tensor:
    assert isinstance(tensor, DTensor)
    return tensor.full_tensor().detach().clone()


def _pending(model: nn.Module) -> list[str]:
    """Labels of the units with a reduction issued but not landed yet."""
    return [s.unit.comm_label for s in states_in([model]) if s.unit.reductions.issued]


def _root_state(model: nn.Module) -> UnitState:
    state = get_state(model)
    assert state is not None
    return state


def _accumulate(
    impl: Impl, use_flag: bool, max_buffers: int = 1, two_d: bool = False
) -> dict[str, Any]:
    model = _sharded(impl, two_d)
    root: Any = model
    if max_buffers != 1:
        root.set_reduce_scatter_max_input_buffers(max_buffers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pending_after: list[list[str]] = []
    for micro, x in enumerate(_data()):
        last = micro == MICRO_BATCHES - 1
        if use_flag:
            root.set_is_last_backward(last)
        if two_d:
            root.set_requires_all_reduce(last)  # the replica all-reduce deferred as well
        model(x).square().sum().backward()
        if impl == "shard":
            pending_after.append(_pending(model))
    grads = {n: _local(p.grad) for n, p in model.named_parameters()}
    full_grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    optimizer.step()
    return {
        "grads": grads,
        "full_grads": full_grads,
        "params": {n: _local(p) for n, p in model.named_parameters()},
        "full_params": {n: _full(p) for n, p in model.named_parameters()},
        "pending_after": pending_after,
    }


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize(
    ("world", "max_buffers", "two_d"),
    [(2, 1, False), (2, 3, False), (4, 1, True)],
    ids=["one-in-flight", "three-in-flight", "2d-deferred-all-reduce"],
)
def test_accumulation_with_non_last_backwards_is_bitwise_unchanged(
    rank_pool: RankPool, world: int, max_buffers: int, two_d: bool
) -> None:
    """False, False, True over three micro-batches gives bitwise the gradients and stepped
    parameters of never calling it (one or three reductions in flight; on a 2x2 mesh with
    the replica all-reduce deferred too), and PyTorch's fully_shard's values."""
    never = rank_pool.run(_accumulate, world, "shard", False, max_buffers, two_d)
    flagged = rank_pool.run(_accumulate, world, "shard", True, max_buffers, two_d)
    torch_run = rank_pool.run(_accumulate, world, "torch", True, max_buffers, two_d)
    for plain, deferred, reference in zip(never, flagged, torch_run, strict=True):
        _assert_bitwise(deferred["grads"], plain["grads"])
        _assert_bitwise(deferred["params"], plain["params"])
        assert any(bool(g.any()) for g in plain["grads"].values())
        for name, grad in reference["full_grads"].items():
            torch.testing.assert_close(deferred["full_grads"][name], grad)
            torch.testing.assert_close(
                deferred["full_params"][name], reference["full_params"][name]
            )
        # What the flag leaves in flight: the last units reduced, never after a last backward.
        assert plain["pending_after"] == [[]] * MICRO_BATCHES
        # Backward reduces the root (model[4]) first and model[0]'s unit last.
        in_flight = ["0"] if max_buffers == 1 else ["Sequential", "0", "2"]
        assert deferred["pending_after"] == [in_flight, in_flight, []]


def _observable() -> dict[str, Any]:
    model = _sharded("shard")
    root: Any = model
    state = _root_state(model)
    x = _data()
    root.set_is_last_backward(False)
    model(x[0]).square().sum().backward()
    after_backward = _pending(model)
    in_context = len(state.unit.comm_ctx.in_flight)
    out = model(x[1])  # the next forward overlaps the reduction: it does not land it
    after_forward = _pending(model)
    first_grad_before = model[0].weight.grad
    out.square().sum().backward()  # still False: the next reductions land it
    after_second = _pending(model)
    root.set_is_last_backward(True)
    model(x[2]).square().sum().backward()
    return {
        "after_backward": after_backward,
        "in_context": in_context,
        "after_forward": after_forward,
        "first_grad_before": first_grad_before is None,
        "after_second": after_second,
        "after_last": _pending(model),
        "left_in_context": len(state.unit.comm_ctx.in_flight),
        "flag": state.is_last_backward,
    }


def test_the_flag_leaves_a_reduction_in_flight_until_a_last_backward(
    rank_pool: RankPool,
) -> None:
    """After a backward with False the last unit's reduction is still pending, through the
    next forward too; a backward with True lands every one."""
    for result in rank_pool.run(_observable, 2):
        assert result["after_backward"] == ["0"]
        assert result["in_context"] == 1
        assert result["after_forward"] == ["0"]
        # Its gradient appears only when the reduction lands.
        assert result["first_grad_before"]
        assert result["after_second"] == ["0"]
        assert result["after_last"] == []
        assert result["left_in_context"] == 0
        assert result["flag"] is True


def _then(action: str) -> dict[str, Any]:
    """One backward with False, then ``action``; the gradients afterwards."""
    model = _sharded("shard")
    root: Any = model
    x = _data()
    root.set_is_last_backward(False)
    model(x[0]).square().sum().backward()
    assert _pending(model) == ["0"]
    if action == "state_dict":
        model.state_dict()
    elif action == "reset_iter_state":
        root.reset_iter_state()
    elif action == "reshard":
        root.reshard()
    elif action == "unshard":
        root.unshard()
        root.reshard()
    elif action == "to":
        model.to(torch.float32)
    elif action == "next_backward":
        root.set_is_last_backward(True)
        model(x[1]).square().sum().backward()
    elif action == "optimizer_step":
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    else:
        raise AssertionError(f"unknown action {action!r}")
    return {
        "pending": _pending(model),
        "grads": {n: _local(p.grad) for n, p in model.named_parameters()},
        "params": {n: _local(p) for n, p in model.named_parameters()},
    }


def _reference(micro_batches: int, step: bool) -> dict[str, dict[str, torch.Tensor]]:
    model = _sharded("shard")
    for x in _data()[:micro_batches]:
        model(x).square().sum().backward()
    if step:
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    return {
        "grads": {n: _local(p.grad) for n, p in model.named_parameters()},
        "params": {n: _local(p) for n, p in model.named_parameters()},
    }


def _then_and_reference(action: str) -> dict[str, Any]:
    result = _then(action)
    result["reference"] = _reference(
        2 if action == "next_backward" else 1, step=action == "optimizer_step"
    )
    return result


@pytest.mark.parametrize(
    "action",
    [
        "state_dict",
        "reset_iter_state",
        "reshard",
        "unshard",
        "to",
        "next_backward",
        "optimizer_step",
    ],
)
def test_pending_reductions_land_before_shard_touches_gradients(
    rank_pool: RankPool, action: str
) -> None:
    """After a backward with False, a state dict, reset_iter_state, unshard/reshard, .to(),
    the next (last) backward or an optimizer step lands the pending reduction: no gradient
    is lost or doubled, and the step sees the complete gradients."""
    for result in rank_pool.run(_then_and_reference, 2, action):
        assert result["pending"] == []
        _assert_bitwise(result["grads"], result["reference"]["grads"])
        _assert_bitwise(result["params"], result["reference"]["params"])
