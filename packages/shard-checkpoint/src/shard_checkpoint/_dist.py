"""The few collectives the state-dict and checkpoint code needs, usable without a process group.

Every function here works in a single process too (no ``torch.distributed``
initialized): rank 0 of a world of one, where a broadcast returns its input.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist

from shard_comms import broadcast

__all__ = [
    "all_gather_objects",
    "broadcast_object",
    "broadcast_tensor",
    "is_distributed",
    "rank",
    "world_size",
]

T = TypeVar("T")


def is_distributed(group: dist.ProcessGroup | None = None) -> bool:
    """Whether collectives over ``group`` (the default group when ``None``) involve other ranks."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group``; 0 without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Size of ``group``; 1 without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def broadcast_object(obj: T, group: dist.ProcessGroup | None = None) -> T:
    """``obj`` of rank 0 of ``group`` on every rank (picklable objects only)."""
    if not is_distributed(group):
        return obj
    box: list[object] = [obj]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]  # type: ignore[return-value]


def broadcast_tensor(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *, label: str
) -> torch.Tensor:
    """Copy rank 0's ``tensor`` (contiguous) into every rank's ``tensor``, in place; return it."""
    if is_distributed(group):
        broadcast(tensor, src=0, group=group, label=label, phase="checkpoint broadcast")
    return tensor


def all_gather_objects(obj: T, group: dist.ProcessGroup | None = None) -> list[T]:
    """Every rank's ``obj``, in rank order (picklable objects only)."""
    if not is_distributed(group):
        return [obj]
    out: list[object] = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out  # type: ignore[return-value]
