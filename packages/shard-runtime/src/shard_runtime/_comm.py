"""The collectives the engine issues, in one place.

Every collective a unit runs goes through these three functions, so the
engine has a single seam to shard-comms (counters, profiler labels, the
per-backend fastest path) and world size 1 never reaches ``torch.distributed``.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
import torch.distributed as dist

__all__ = ["Pending", "all_gather", "all_reduce", "reduce_scatter"]


class Pending(Protocol):
    """An issued collective; ``wait()`` blocks until its output is ready."""

    def wait(self) -> object: ...


class _Done:
    def wait(self) -> object:
        return True


_DONE = _Done()


def all_gather(
    output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, *, label: str
) -> Pending:
    """Gather every rank's equally sized ``shard`` into ``output`` (rank-major)."""
    if dist.get_world_size(group) == 1:
        output.copy_(shard)
        return _DONE
    work = dist.all_gather_single(output, shard, group=group, async_op=True)
    assert work is not None
    return cast(Pending, work)


def reduce_scatter(
    output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup, *, label: str
) -> Pending:
    """Sum ``full`` across ranks; ``output`` receives this rank's slice."""
    world = dist.get_world_size(group)
    if world == 1:
        output.copy_(full)
        return _DONE
    work = dist.reduce_scatter_single(output, full, group=group, async_op=True)
    assert work is not None
    return cast(Pending, work)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, *, label: str) -> Pending:
    """Sum ``tensor`` in place across ranks."""
    if dist.get_world_size(group) == 1:
        return _DONE
    work = dist.all_reduce(tensor, group=group, async_op=True)
    assert work is not None
    return cast(Pending, work)
