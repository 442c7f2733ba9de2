"""DTensors built from the piece this rank holds, without communication."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from shard_core import contiguous_stride

__all__ = ["contiguous_dtensor"]


def contiguous_dtensor(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: Sequence[int],
) -> DTensor:
    """A DTensor of global ``shape`` (contiguous strides) whose piece on this rank is ``local``.

    ``local`` is used as it is (no copy); nothing is checked across ranks, so
    every rank must pass its own piece of the same ``shape`` and ``placements``.
    """
    return DTensor.from_local(
        local,
        mesh,
        placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=contiguous_stride(shape),
    )
