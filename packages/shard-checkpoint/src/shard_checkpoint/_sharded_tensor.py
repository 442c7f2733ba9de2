"""PyTorch's ``ShardedTensor`` values, as the ``DTensor`` each one describes.

PyTorch's ``FullyShardedDataParallel`` gives ``SHARDED_STATE_DICT`` (without a
device mesh) and ``LOCAL_STATE_DICT`` values, and their optimizer state, as
``ShardedTensor`` s: each rank holds ``torch.chunk``'s piece of dim 0, the
layout of a ``Shard(0)`` DTensor. shard's wrapper loads those state dicts
once each such value is turned into that DTensor, over a mesh of the
ShardedTensor's own process group; the local piece is used as it is, with no
communication. ``ShardedTensor`` is PyTorch's legacy type, so its module is
only looked at when the user's code has imported it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from shard_checkpoint._errors import StateDictError
from shard_core import dim0_chunk_range
from shard_runtime.plumbing import contiguous_dtensor

__all__ = ["dtensors_for_sharded_tensors"]

_MODULE = "torch.distributed._shard.sharded_tensor"


def dtensors_for_sharded_tensors(state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state_dict`` (nested dicts too) with every ``ShardedTensor`` as its DTensor.

    Returns ``state_dict`` itself when it holds none.

    Raises:
        StateDictError: a ShardedTensor not laid out as ``torch.chunk`` of dim 0,
            naming its key.
    """
    module = sys.modules.get(_MODULE)
    if module is None:
        return state_dict
    meshes: dict[int, DeviceMesh] = {}
    converted = _convert(state_dict, module.ShardedTensor, meshes, "")
    return converted if isinstance(converted, Mapping) else state_dict


def _convert(value: Any, kind: type, meshes: dict[int, DeviceMesh], key: str) -> Any:
    if isinstance(value, kind):
        return _as_dtensor(value, meshes, key)
    if isinstance(value, Mapping):
        items = {
            k: _convert(v, kind, meshes, f"{key}.{k}" if key else str(k)) for k, v in value.items()
        }
        if all(items[k] is v for k, v in value.items()):
            return value
        return items
    return value


def _as_dtensor(value: Any, meshes: dict[int, DeviceMesh], key: str) -> DTensor:
    group = value._process_group
    shape = tuple(value.size())
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    shards = [s for s in value.local_shards() if s.tensor.numel()]  # a rank past the chunks
    rows = dim0_chunk_range(shape[0], rank, world) if shape else range(0)
    expected = [(rows.start, *([0] * (len(shape) - 1)))] if len(rows) else []
    offsets = [tuple(s.metadata.shard_offsets) for s in shards]
    sizes_ok = all(s.tensor.shape[0] == len(rows) for s in shards)
    if not shape or offsets != expected or not sizes_ok:
        raise StateDictError(
            f"{key!r} is a ShardedTensor whose pieces are not torch.chunk's rows of dim 0 "
            f"(this rank holds offsets {offsets}, expected {expected}); load a FULL_STATE_DICT, "
            "or DTensors (a SHARDED_STATE_DICT of a model wrapped with a device_mesh)"
        )
    if shards:
        local = shards[0].tensor
    else:
        local = torch.empty((0, *shape[1:]), dtype=value.dtype, device=_device_of(value))
    mesh = meshes.get(id(group))
    if mesh is None:
        mesh = meshes[id(group)] = DeviceMesh.from_group(group, local.device.type)
    return contiguous_dtensor(local, mesh, [Shard(0)], shape)


def _device_of(value: Any) -> torch.device:
    for shard in value.metadata().shards_metadata:
        device = shard.placement.device()
        if device is not None:
            return torch.device(device.type)
    return torch.device("cpu")
