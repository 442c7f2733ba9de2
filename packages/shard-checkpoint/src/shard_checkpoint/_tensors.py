"""Moving one value between its full and its sharded form.

A sharded value is a ``DTensor`` whose placements are ``Shard(dim)`` or
``Replicate()`` per mesh axis (``fully_shard`` uses ``Shard(0)``, or
``(Replicate(), Shard(0))`` on a 2-D mesh). Its local tensor is what
``torch.chunk`` gives this rank along each sharded axis in turn, which is
what :func:`local_chunk` cuts out of a full tensor without communication.
Tensor parallelism under ``fully_shard`` adds ``_StridedShard`` placements
(the data-parallel split of a dim that "tp" already split): their rows are
interleaved, so that piece is gathered by index (see [Note: strided pieces]).

[Note: strided pieces]
A placement that is neither ``Shard`` nor ``Replicate`` is cut by DTensor's
own rule, never a copy of it: per tensor dim, ``distribute_tensor`` (local
splitting only, ``src_data_rank=None``) of the dim's index range under the
placements that split that dim says which indices this rank holds, and
``index_select`` takes them. Dims are split independently, so the index
ranges are 1-D and cheap whatever the tensor's size.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Partial, Placement, _StridedShard

from shard_checkpoint._errors import StateDictError
from shard_core import dim0_chunk_range
from shard_runtime.plumbing import contiguous_dtensor, is_tensor_subclass

__all__ = ["full_value", "local_chunk", "same_layout", "shard_like", "to_cpu"]


def local_chunk(full: torch.Tensor, like: DTensor, *, key: str) -> torch.Tensor:
    """This rank's piece of ``full`` when laid out like ``like`` (a view, no communication).

    ``key`` names the value in errors.
    """
    coordinate = like.device_mesh.get_coordinate()
    if coordinate is None:
        raise StateDictError(
            f"{key!r}: this rank is not part of the mesh of its DTensor ({like.device_mesh}); "
            "load state dicts on the ranks of the model's mesh"
        )
    if any(type(p) not in (Shard, Replicate) for p in like.placements):
        return _strided_chunk(full, like, key=key)
    piece = full
    for axis, placement in enumerate(like.placements):
        if type(placement) is Shard:
            dim = placement.dim if placement.dim >= 0 else piece.dim() + placement.dim
            size, index = like.device_mesh.size(axis), coordinate[axis]
            rows = dim0_chunk_range(piece.shape[dim], index, size)
            if is_tensor_subclass(piece) and len(rows) > 0:
                # A subclass (torchao's NF4) cuts itself with chunk, not with any slice.
                piece = torch.chunk(piece, size, dim=dim)[index]
            else:
                piece = piece.narrow(dim, rows.start, len(rows))
        elif not isinstance(placement, Replicate):
            raise StateDictError(
                f"{key!r}: cannot cut a full tensor into a DTensor placed {like.placements}; "
                "only Shard(dim) and Replicate() placements can be loaded from full tensors"
            )
    return piece


def _strided_chunk(full: torch.Tensor, like: DTensor, *, key: str) -> torch.Tensor:
    """:func:`local_chunk` for any placements but Partial (a copy; see [Note: strided pieces])."""
    if any(isinstance(p, Partial) for p in like.placements):
        raise StateDictError(
            f"{key!r}: cannot cut a full tensor into a DTensor placed {like.placements}; a "
            "Partial placement holds unreduced values: redistribute the parameter to Shard or "
            "Replicate before loading"
        )
    piece = full
    for dim in range(full.dim()):
        per_axis: list[Placement] = []
        for placement in like.placements:
            if isinstance(placement, _StridedShard) and _dim_of(placement, full) == dim:
                per_axis.append(_StridedShard(0, split_factor=placement.split_factor))
            elif isinstance(placement, Shard) and _dim_of(placement, full) == dim:
                per_axis.append(Shard(0))
            else:
                per_axis.append(Replicate())
        if all(isinstance(p, Replicate) for p in per_axis):
            continue
        indices = torch.arange(full.shape[dim])
        held = distribute_tensor(indices, like.device_mesh, per_axis, src_data_rank=None)
        piece = piece.index_select(dim, held.to_local().to(piece.device))
    return piece


def _dim_of(placement: Shard | _StridedShard, full: torch.Tensor) -> int:
    return placement.dim if placement.dim >= 0 else full.dim() + placement.dim


def shard_like(full: torch.Tensor, like: DTensor, *, key: str, copy: bool = False) -> DTensor:
    """``full`` as a DTensor laid out like ``like``, on its local tensor's device.

    ``copy=True`` gives the DTensor its own storage, so that ``full`` can be
    freed; otherwise the local tensor may be a view of ``full``.
    """
    device = like.to_local().device
    piece = local_chunk(full, like, key=key)
    # A subclass already in place is kept as it is: its ``to`` may convert (NF4's dequantizes).
    if copy or piece.device != device or not is_tensor_subclass(piece):
        piece = piece.to(device=device, copy=copy, memory_format=torch.contiguous_format)
    return contiguous_dtensor(piece, like.device_mesh, like.placements, like.shape)


def same_layout(value: DTensor, like: DTensor) -> bool:
    """Whether ``value`` is sharded exactly like ``like`` (its local tensor can be used as is)."""
    return (
        value.device_mesh == like.device_mesh
        and tuple(value.placements) == tuple(like.placements)
        and value.shape == like.shape
    )


def full_value(value: torch.Tensor) -> torch.Tensor:
    """The full tensor of ``value``: gathered for a DTensor (a collective), ``value`` otherwise."""
    if isinstance(value, DTensor):
        with torch.no_grad():
            return value.full_tensor()
    return value


def to_cpu(value: torch.Tensor) -> torch.Tensor:
    """``value`` on the CPU; a DTensor keeps its mesh and placements, with a CPU local tensor."""
    if isinstance(value, DTensor):
        local = value.to_local()
        if local.device.type == "cpu":
            return value
        return DTensor.from_local(
            local.cpu(),
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    return value.cpu()
