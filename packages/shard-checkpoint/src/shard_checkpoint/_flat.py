"""Per-parameter values from a ``FullyShardedDataParallel`` unit's flat shards, and back.

A wrapper unit keeps its parameters (and an optimizer keeps their state) as
one flat 1-D shard per rank: elements ``[r * n, (r + 1) * n)`` of the
parameters laid back to back (``FlatLayout``). State dicts speak per
parameter, under the unwrapped model's names. This module converts:

- out: all-gather one flat tensor of the unit over its shard axis and view it
  as each parameter's full tensor; keep it, or cut this rank's ``torch.chunk``
  rows as a ``Shard(0)`` DTensor (the same layout ``fully_shard`` uses, so
  checkpoints move between front ends);
- in: from full per-parameter values (cut from DTensors by gathering them,
  or received from rank 0), write this rank's flat shard with
  ``FlatLayout.shard``; no communication when the values are full.

[Note: one unit at a time]
Every conversion handles one unit (and one optimizer state name) at a time
and drops its full tensors before the next, so beyond its shards a rank
holds at most one unit's full parameters. Copying out of the gathered buffer
happens inside :func:`gathered_copies`, so the buffer dies when it returns: a
view of it kept in the caller's loop variable held it alive through the next
unit's gather (``tests/test_gather_lifetimes.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from shard_checkpoint._errors import StateDictError
from shard_core import dim0_chunk_range
from shard_runtime.plumbing import FlatUnit, contiguous_dtensor

__all__ = [
    "FLAT_PARAM",
    "chunk_of",
    "flat_key",
    "gather_full",
    "gathered_copies",
    "local_flat",
    "write_shard",
]

FLAT_PARAM = "_flat_param"


def flat_key(unit: FlatUnit, wrapper_names: dict[int, str]) -> str:
    """The key of ``unit``'s flat shard in a LOCAL state dict (``<wrapper>._flat_param``)."""
    prefix = wrapper_names[id(unit.wrapper)]
    return f"{prefix}.{FLAT_PARAM}" if prefix else FLAT_PARAM


def gather_full(unit: FlatUnit, local: torch.Tensor, *, label: str) -> list[torch.Tensor]:
    """Each parameter's full tensor from this rank's flat ``local`` (views of one buffer).

    A collective over the unit's shard axis.
    """
    if local.numel() != unit.shard_numel:
        raise StateDictError(
            f"{label}: a flat shard of {local.numel()} elements, but the unit of "
            f"{unit.params[0].keys[0]!r} holds {unit.shard_numel} per rank"
        )
    full = unit.gather(local, label=label)
    return list(unit.layout.views(full))


def chunk_of(full: torch.Tensor, unit: FlatUnit, *, offload_to_cpu: bool) -> DTensor:
    """This rank's ``torch.chunk`` rows of ``full`` as a DTensor over the unit's mesh."""
    mesh = unit.mesh
    rows = dim0_chunk_range(full.shape[0], unit.rank, unit.world)
    local = full.narrow(0, rows.start, len(rows)).clone()
    if offload_to_cpu:
        local = local.cpu()
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    return contiguous_dtensor(local, mesh, placements, full.shape)


def gathered_copies(
    unit: FlatUnit,
    local: torch.Tensor,
    *,
    label: str,
    full: bool,
    offload_to_cpu: bool,
    wanted: Collection[int],
) -> dict[int, torch.Tensor]:
    """The ``wanted`` parameters' values (by index in the unit), copied out of its gathered buffer.

    A collective over the unit's shard axis: every rank calls it, wanting
    values or not. ``full``: each value is the full tensor (on the CPU with
    ``offload_to_cpu``); else this rank's ``torch.chunk`` rows as a DTensor
    (:func:`chunk_of`). See [Note: one unit at a time].
    """
    views = gather_full(unit, local, label=label)
    return {
        index: (
            views[index].to("cpu" if offload_to_cpu else views[index].device, copy=True)
            if full
            else chunk_of(views[index], unit, offload_to_cpu=offload_to_cpu)
        )
        for index in wanted
    }


def local_flat(unit: FlatUnit, value: torch.Tensor, *, key: str) -> torch.Tensor:
    """This rank's flat shard from a LOCAL state dict's value for ``key``.

    A DTensor laid out like the unit (the unpadded flat buffer, or the padded
    one earlier versions wrote, over the same shard count) gives its local
    piece, padded back to the shard's size; one written by another number of
    ranks is gathered and cut again (the layout without padding does not
    depend on the world size). A plain tensor must be this rank's shard, with
    or without its padding.
    """
    n = unit.shard_numel
    if isinstance(value, DTensor):
        shards = value.device_mesh.size(value.device_mesh.ndim - 1)
        if shards == unit.world and value.shape[0] in (unit.layout.total_numel, n * unit.world):
            local = value.to_local()
            if local.numel() == n:
                return local
            padded = local.new_zeros(n)
            padded[: local.numel()].copy_(local)
            return padded
        with torch.no_grad():
            full = value.full_tensor()
        if full.dim() != 1 or full.numel() < unit.layout.total_numel:
            raise StateDictError(
                f"{key!r} holds a flat buffer of shape {tuple(full.shape)}, but this unit's "
                f"parameters take {unit.layout.total_numel} elements; load a LOCAL state dict "
                "of the same model and wrapping"
            )
        return unit.layout.shard(full, unit.rank, unit.world)
    valid = len(dim0_chunk_range(unit.layout.total_numel, unit.rank, unit.world))
    if value.dim() == 1 and value.numel() == valid < n:  # the unpadded piece (to_local())
        padded = value.new_zeros(n)
        padded[:valid].copy_(value)
        return padded
    if value.dim() != 1 or value.numel() != n:
        raise StateDictError(
            f"{key!r} holds {value.numel()} elements, but this rank's shard of the unit holds "
            f"{n} ({unit.world} ranks); a LOCAL state dict of plain tensors loads only at the "
            "world size and wrapping that wrote it: save FULL_STATE_DICT or "
            "SHARDED_STATE_DICT to load elsewhere"
        )
    return value


def write_shard(
    unit: FlatUnit,
    fulls: Sequence[torch.Tensor | None],
    *,
    current: Callable[[], list[torch.Tensor]],
    label: str,
) -> None:
    """Write this rank's flat shard of ``unit`` from full per-parameter values.

    ``None`` keeps a parameter's current value (``current`` gathers them,
    only when some value is missing).
    """
    unit.ensure_sharded()
    shard = unit.shard
    present = list(fulls)
    if any(v is None for v in present):
        now = current()
        present = [v if v is not None else now[i] for i, v in enumerate(present)]
    tensors: list[torch.Tensor] = []
    for param, value in zip(unit.params, present, strict=True):
        assert value is not None
        if tuple(value.shape) != tuple(param.shape):
            raise StateDictError(
                f"{label}: {param.keys[0]!r} has shape {tuple(value.shape)} in the state dict "
                f"but {tuple(param.shape)} in the model; load a state dict of this model"
            )
        tensors.append(value.to(device=shard.device, dtype=shard.dtype))
    with torch.no_grad():
        unit.layout.shard(tensors, unit.rank, unit.world, out=shard)
