"""Per-parameter dim-0 sharding math: which rows each rank holds.

The composable front end (``fully_shard``) shards every parameter on dim 0
with ``torch.chunk`` semantics, so that a parameter's shard is a plain slice
of rows and checkpoints line up with PyTorch's. These are the numbers it
needs (and ``shard plan`` estimates with); the tensors themselves are the
runtime's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from shard_core._layout import ceil_div
from shard_core._validate import check_rank, check_world_size
from shard_core.errors import LayoutError

__all__ = ["contiguous_stride", "dim0_chunk_range", "padded_dim0_size"]

# [Note: Chunk semantics]
# A parameter with d rows over N ranks is cut into chunks of c = ceil(d / N) rows:
# rank r holds rows [r * c, min((r + 1) * c, d)), which is torch.chunk(param, N)[r],
# or an empty (0, *rest) slice where torch.chunk returns fewer than N chunks
# (d=5, N=4: 2, 2, 1, 0 rows; d=9, N=4: 3, 3, 3, 0; d=3, N=4: 1, 1, 1, 0).
# Every rank contributes c rows to an all-gather (its rows, then zero rows).
# Only the last non-empty chunk can be short and every chunk after it is empty, so
# the parameter's rows are exactly the first d rows of the gathered (N * c, *rest)
# buffer: unpadding is a view, never a copy, even when shards are uneven.


def _check_dim0(dim0: int) -> None:
    if not isinstance(dim0, int) or isinstance(dim0, bool) or dim0 < 0:
        raise LayoutError(f"dim0 must be an integer >= 0 (a number of rows), got {dim0!r}")


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Strides of a contiguous tensor of ``shape`` (what a full parameter's DTensor declares)."""
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def padded_dim0_size(dim0: int, world_size: int) -> int:
    """Rows each rank contributes to the all-gather: ``ceil(dim0 / world_size)``.

    This is the size of chunk 0, the largest chunk. See [Note: Chunk semantics].
    """
    _check_dim0(dim0)
    check_world_size(world_size)
    return ceil_div(dim0, world_size)


def dim0_chunk_range(dim0: int, rank: int, world_size: int) -> range:
    """The rows ``rank`` holds of a dim-0 size ``dim0`` (empty past the last chunk).

    ``len()`` of it is the rank's unpadded row count; ``start`` is where its
    rows begin in the full tensor.
    """
    check_rank(rank, world_size)
    c = padded_dim0_size(dim0, world_size)
    return range(min(rank * c, dim0), min((rank + 1) * c, dim0))
