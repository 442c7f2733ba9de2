"""Tests of per-parameter dim-0 sharding math: padded sizes and each rank's rows."""

from __future__ import annotations

import pytest
import torch

from shard_core import contiguous_stride, dim0_chunk_range, padded_dim0_size

CASES = [(5, 4), (3, 4), (9, 4), (6, 4), (0, 4), (7, 3), (1, 1), (4, 8), (8, 4), (1, 3)]


@pytest.mark.parametrize(("dim0", "world_size"), CASES)
def test_chunk_ranges_match_torch_chunk(dim0: int, world_size: int) -> None:
    """Per-rank rows are torch.chunk's chunks, empty for ranks torch.chunk leaves out."""
    tensor = torch.arange(float(dim0 * 2)).view(dim0, 2)
    chunks = torch.chunk(tensor, world_size)
    for rank in range(world_size):
        rows = dim0_chunk_range(dim0, rank, world_size)
        expected = chunks[rank] if rank < len(chunks) else tensor[:0]
        assert torch.equal(tensor[rows.start : rows.stop], expected)
    assert padded_dim0_size(dim0, world_size) == (chunks[0].shape[0] if chunks else 0)


def test_chunk_range_per_rank() -> None:
    """Rank r holds rows [r * c, min((r + 1) * c, dim0)), empty past the end."""
    ranges = [dim0_chunk_range(5, r, 4) for r in range(4)]
    assert ranges == [range(0, 2), range(2, 4), range(4, 5), range(5, 5)]
    assert padded_dim0_size(5, 4) == 2


def test_padded_size_is_exact_beyond_float_precision() -> None:
    """ceil(dim0 / N) is computed in integers, exact where float division would round."""
    dim0 = 2**60 + 1
    assert padded_dim0_size(dim0, 2) == 2**59 + 1


def test_contiguous_stride() -> None:
    """Strides of a contiguous tensor, as torch reports them."""
    assert contiguous_stride((2, 3, 4)) == torch.empty(2, 3, 4).stride()
    assert contiguous_stride(()) == ()
