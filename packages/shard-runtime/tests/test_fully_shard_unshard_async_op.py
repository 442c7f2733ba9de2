"""``FSDPModule._set_unshard_async_op``: PyTorch's switch to all-gather as an async unshard.

PyTorch then issues every all-gather of the module's tree (pre-forward,
pre-backward, prefetch) with ``async_op=True`` on the current stream; shard
issues them on the compute stream instead of its all-gather stream. On the
CPU both are seen directly: PyTorch's ``async_op`` flags, and the stream
shard enters for each all-gather. Training does not change: losses and
parameters equal PyTorch's, with the switch on and off, and the collectives
are the same in number.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shard_comms import count_collectives
from shard_core.protocols import StreamLike
from shard_runtime import fully_shard
from shard_runtime._comm import streams_for
from shard_runtime._state import states_in
from shard_testing import RankPool
from shard_testing.compat import fsdp_namespace, torch_fsdp_collectives
from shard_testing.models import data_parallel_mesh, sharded_toy_net, toy_batches

_STEPS = 2


@contextmanager
def _gather_streams() -> Iterator[list[str]]:
    """The stream (``"all_gather"``, ``"compute"``) shard enters for each all-gather.

    Reduce-scatters enter their own stream, which is not listed.
    """
    streams = streams_for(torch.device("cpu"))
    handle = streams.handle
    names = {id(streams.all_gather): "all_gather", id(streams.current()): "compute"}
    entered: list[str] = []
    original = handle.stream

    def stream(s: StreamLike) -> AbstractContextManager[None]:
        if id(s) in names:
            entered.append(names[id(s)])
        return original(s)

    handle.stream = stream  # type: ignore[method-assign]
    try:
        yield entered
    finally:
        del handle.stream  # type: ignore[method-assign]


def _train(impl: str, async_op: bool) -> dict[str, Any]:
    model = sharded_toy_net(fsdp_namespace(impl).fully_shard, mesh=data_parallel_mesh())
    if async_op:
        model._set_unshard_async_op(True)  # type: ignore[operator]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = toy_batches(dist.get_world_size(), _STEPS)
    losses, seen = [], []
    for step in range(_STEPS):
        x, y = batches[step][0][dist.get_rank()]
        with (
            torch_fsdp_collectives() as torch_calls,
            count_collectives() as counts,
            _gather_streams() as streams,
        ):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
        if impl == "torch":
            seen.append(torch_calls["all_gather"])
        else:
            assert counts.calls("all_gather") == len(streams)
            seen.append(streams)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": [p.full_tensor().tolist() for p in model.parameters()],  # type: ignore[attr-defined]
        "gathers": seen,
    }


def _flags() -> list[list[bool]]:
    """Each unit's switch after setting it on the root, then off on the first block only."""
    model = sharded_toy_net(fully_shard, mesh=data_parallel_mesh())
    units = [u for s in states_in([model]) for u in s.units]
    seen = []
    model._set_unshard_async_op(True)  # type: ignore[operator]
    seen.append([u.unshard_async_op for u in units])
    model.blocks[0]._set_unshard_async_op(False)  # type: ignore[operator]
    seen.append([u.unshard_async_op for u in units])
    return seen


def _both() -> dict[str, Any]:
    runs = {
        f"{impl}/{'async' if on else 'default'}": _train(impl, on)
        for impl in ("torch", "shard")
        for on in (False, True)
    }
    return {"runs": runs, "flags": _flags()}


def test_set_unshard_async_op_gathers_like_pytorch(rank_pool: RankPool) -> None:
    """With the switch, every all-gather is PyTorch's async_op=True and shard's runs on the
    compute stream (without it: False, and the all-gather stream); training is PyTorch's. The
    switch reaches the units of the module it is called on and of those below it."""
    for both in rank_pool.run(_both, 2):
        result = both["runs"]
        reference = result["torch/default"]
        # 4 units gather in forward, the 3 blocks again in backward (the root keeps its own).
        assert reference["gathers"] == [[False] * 7] * _STEPS
        assert result["torch/async"]["gathers"] == [[True] * 7] * _STEPS
        assert result["shard/default"]["gathers"] == [["all_gather"] * 7] * _STEPS
        assert result["shard/async"]["gathers"] == [["compute"] * 7] * _STEPS
        for name, run in result.items():
            assert run["losses"] == reference["losses"], name
            assert run["params"] == reference["params"], name
        # The root's unit, then the three blocks': set below the module it is called on.
        assert both["flags"] == [[True] * 4, [True, False, True, True]]
