"""Property tests of the flat layout and dim-0 sharding over random shapes and world sizes."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shard_core import FlatLayout, dim0_chunk_range, padded_dim0_size

FAST = settings(max_examples=60, deadline=None)

shapes_any = st.lists(
    st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple), min_size=1, max_size=6
)
alignments = st.integers(1, 8)
world_sizes = st.integers(1, 8)


def _tensors(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Distinct, non-zero values everywhere, so that a misplaced or dropped element shows."""
    out, start = [], 1.0
    for shape in shapes:
        n = math.prod(shape)
        out.append(torch.arange(start, start + n).view(shape))
        start += n
    return out


def _layout(shapes: list[tuple[int, ...]], alignment: int) -> FlatLayout:
    specs = [(f"p{i}", shape) for i, shape in enumerate(shapes)]
    return FlatLayout.from_specs(specs, dtype=torch.float32, device="cpu", alignment=alignment)


@FAST
@given(shapes=shapes_any, alignment=alignments, world_size=world_sizes)
def test_gathered_shards_give_back_the_flat_buffer(
    shapes: list[tuple[int, ...]], alignment: int, world_size: int
) -> None:
    """Every rank's shard, concatenated, is the flat buffer followed by zero tail padding."""
    layout = _layout(shapes, alignment)
    tensors = _tensors(shapes)
    flat = layout.flatten(tensors)
    shards = [layout.shard(tensors, r, world_size) for r in range(world_size)]
    for r, shard in enumerate(shards):
        assert torch.equal(shard, layout.shard(flat, r, world_size))
    gathered = torch.cat(shards)
    assert gathered.numel() == layout.padded_numel(world_size)
    assert torch.equal(gathered[: layout.total_numel], flat)
    assert not gathered[layout.total_numel :].any()
    assert torch.equal(gathered, layout.flatten(tensors, world_size=world_size))
    for view, tensor in zip(layout.views(gathered), tensors, strict=True):
        assert torch.equal(view, tensor)


@FAST
@given(shapes=shapes_any, alignment=alignments)
def test_views_alias_the_flat_storage(shapes: list[tuple[int, ...]], alignment: int) -> None:
    """Each view starts at its offset in the flat buffer, and writing it writes the buffer."""
    layout = _layout(shapes, alignment)
    flat = layout.flatten(_tensors(shapes))
    item = flat.element_size()
    views = layout.views(flat)
    for i, view in enumerate(views):
        if view.numel():
            assert view.data_ptr() == flat.data_ptr() + layout.offsets[i] * item
        view.fill_(-float(i + 1))
    expected = torch.zeros(layout.total_numel)
    for i, (off, spec) in enumerate(zip(layout.offsets, layout.params, strict=True)):
        expected[off : off + spec.numel] = -float(i + 1)
    assert torch.equal(flat, expected)


@FAST
@given(shapes=shapes_any, alignment=alignments, world_size=world_sizes)
def test_metadata_covers_every_parameter_element_once(
    shapes: list[tuple[int, ...]], alignment: int, world_size: int
) -> None:
    """Across ranks the metadata names each parameter element exactly once, padding never."""
    layout = _layout(shapes, alignment)
    counts = torch.zeros(layout.padded_numel(world_size), dtype=torch.int64)
    for rank in range(world_size):
        meta = layout.shard_metadata(rank, world_size)
        shard = layout.shard(_tensors(shapes), rank, world_size)
        pieces = layout.shard_views(shard, rank, world_size)
        for info, piece in zip(meta.params, pieces, strict=True):
            start = layout.offsets[info.index] + info.start
            assert meta.flat_range.start + info.offset_in_range == start
            counts[start : start + info.numel_in_range] += 1
            whole = _tensors(shapes)[info.index].reshape(-1)
            assert torch.equal(piece, whole[info.start : info.end + 1])
    expected = torch.zeros_like(counts)
    for off, spec in zip(layout.offsets, layout.params, strict=True):
        expected[off : off + spec.numel] = 1
    assert torch.equal(counts, expected)


@FAST
@given(
    dim0=st.integers(0, 20),
    rest=st.lists(st.integers(0, 4), max_size=2),
    world_size=world_sizes,
)
def test_dim0_chunks_pad_gather_and_unpad_to_the_tensor(
    dim0: int, rest: list[int], world_size: int
) -> None:
    """Each rank's rows, zero-padded to padded_dim0_size and gathered, start with the tensor."""
    shape = (dim0, *rest)
    tensor = torch.arange(1.0, 1.0 + math.prod(shape)).view(shape)
    padded = padded_dim0_size(dim0, world_size)
    blocks = []
    for rank in range(world_size):
        rows = dim0_chunk_range(dim0, rank, world_size)
        block = torch.zeros(padded, *rest)
        block[: len(rows)] = tensor[rows.start : rows.stop]
        blocks.append(block)
    gathered = torch.cat(blocks)
    assert not gathered[dim0:].any()
    assert torch.equal(gathered[:dim0], tensor)
