"""Tests of per-parameter dim-0 sharding: chunk sizes, padding, unpadding and packing."""

from __future__ import annotations

import pytest
import torch

from shard_core import (
    PackedDim0Layout,
    chunk_dim0,
    dim0_chunk_range,
    dim0_chunk_sizes,
    pad_dim0,
    padded_dim0_size,
    unpad_dim0,
)

CASES = [(5, 4), (3, 4), (9, 4), (6, 4), (0, 4), (7, 3), (1, 1), (4, 8), (8, 4), (1, 3)]


@pytest.mark.parametrize(("dim0", "world_size"), CASES)
def test_chunk_sizes_match_torch_chunk(dim0: int, world_size: int) -> None:
    """Per-rank rows are torch.chunk's chunk sizes, with 0 for ranks torch.chunk leaves out."""
    chunks = torch.chunk(torch.zeros(dim0, 2), world_size)
    expected = [c.shape[0] for c in chunks] + [0] * (world_size - len(chunks))
    assert list(dim0_chunk_sizes(dim0, world_size)) == expected
    assert padded_dim0_size(dim0, world_size) == expected[0]


def test_chunk_sizes_of_the_issue_examples() -> None:
    """Five rows over four ranks chunk as 2, 2, 1, 0; three rows as 1, 1, 1, 0."""
    assert dim0_chunk_sizes(5, 4) == (2, 2, 1, 0)
    assert dim0_chunk_sizes(3, 4) == (1, 1, 1, 0)
    assert dim0_chunk_sizes(9, 4) == (3, 3, 3, 0)
    assert padded_dim0_size(5, 4) == 2


def test_chunk_range_per_rank() -> None:
    """Rank r holds rows [r * c, min((r + 1) * c, dim0)), empty past the end."""
    ranges = [dim0_chunk_range(5, r, 4) for r in range(4)]
    assert ranges == [range(0, 2), range(2, 4), range(4, 5), range(5, 5)]


@pytest.mark.parametrize(("dim0", "world_size"), CASES)
def test_chunk_dim0_is_a_view_equal_to_torch_chunk(dim0: int, world_size: int) -> None:
    """chunk_dim0 is torch.chunk's chunk (a view), or an empty (0, *rest) view past it."""
    tensor = torch.arange(float(dim0 * 3)).view(dim0, 3).clone()
    chunks = torch.chunk(tensor, world_size)
    for rank in range(world_size):
        chunk = chunk_dim0(tensor, rank, world_size)
        if rank < len(chunks):
            assert torch.equal(chunk, chunks[rank])
        else:
            assert chunk.shape == (0, 3)
        assert chunk._base is tensor


def test_pad_dim0_appends_zero_rows() -> None:
    """pad_dim0 keeps the rows and appends zero rows up to the padded size."""
    shard = torch.tensor([[1.0, 2.0]])
    padded = pad_dim0(shard, 3)
    assert padded.tolist() == [[1.0, 2.0], [0.0, 0.0], [0.0, 0.0]]


def test_pad_dim0_of_empty_chunk_is_all_zeros() -> None:
    """An empty chunk pads to a block of zero rows."""
    assert pad_dim0(torch.empty(0, 2), 2).tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_pad_dim0_returns_a_full_shard_itself() -> None:
    """A shard that already has the padded size is returned without a copy."""
    shard = torch.ones(2, 2)
    assert pad_dim0(shard, 2) is shard


def test_pad_dim0_into_out_casts_and_returns_out() -> None:
    """pad_dim0(out=...) writes rows and zero padding into out, in out's dtype."""
    out = torch.full((3, 2), 7.0, dtype=torch.bfloat16)
    result = pad_dim0(torch.tensor([[1.0, 2.0]]), 3, out)
    assert result is out
    assert out.tolist() == [[1.0, 2.0], [0.0, 0.0], [0.0, 0.0]]


def test_pad_dim0_does_not_record_autograd() -> None:
    """Padding a shard that requires grad is data movement: the result does not require grad."""
    shard = torch.ones(1, 2, requires_grad=True)
    assert not pad_dim0(shard, 2).requires_grad


def test_unpad_dim0_is_a_view_even_for_uneven_shards() -> None:
    """Gathering 2, 2, 1, 0 rows padded to 2 and unpadding gives back the rows, no copy."""
    full = torch.arange(10.0).view(5, 2)
    gathered = torch.cat([pad_dim0(chunk_dim0(full, r, 4), 2) for r in range(4)])
    assert gathered.shape == (8, 2)
    unpadded = unpad_dim0(gathered, 5, 4)
    assert torch.equal(unpadded, full)
    assert unpadded.data_ptr() == gathered.data_ptr()
    assert unpadded._base is gathered


def _params() -> list[torch.Tensor]:
    return [
        torch.arange(10.0).view(5, 2),
        torch.arange(100.0, 103.0),
        torch.arange(200.0, 224.0).view(3, 2, 4),
    ]


def _layout() -> PackedDim0Layout:
    return PackedDim0Layout.from_tensors(
        [("a", _params()[0]), ("b", _params()[1]), ("c", _params()[2])], world_size=4
    )


def test_packed_layout_sizes_and_offsets() -> None:
    """Each parameter's padded shard (c rows x row numel) sits at its offset in a rank's buffer."""
    layout = _layout()
    assert layout.padded_dim0_sizes == (2, 1, 1)
    assert layout.row_numels == (2, 1, 8)
    assert layout.shard_numels == (4, 1, 8)
    assert layout.offsets == (0, 4, 5)
    assert layout.per_rank_numel == 13
    assert layout.gathered_numel == 52
    assert layout.shard_shape(0, 2) == (1, 2)
    assert layout.shard_shape(2, 3) == (0, 2, 4)
    assert repr(layout) == "PackedDim0Layout(3 params, world_size=4, per_rank_numel=13)"


def test_pack_lays_padded_shards_back_to_back() -> None:
    """Rank 2's buffer holds a's one row and a zero row, b's row, and c's row of 8."""
    params = _params()
    shards = [chunk_dim0(t, 2, 4) for t in params]
    packed = _layout().pack(shards, 2)
    assert packed.tolist() == [8.0, 9.0, 0.0, 0.0, 102.0, *[float(x) for x in range(216, 224)]]


def test_pack_of_a_rank_past_every_chunk_is_all_zeros() -> None:
    """Rank 3 holds no rows of any parameter, so its packed buffer is all padding."""
    packed = _layout().shard(_params(), 3)
    assert packed.tolist() == [0.0] * 13


def test_pack_into_out_casts_and_does_not_record_autograd() -> None:
    """pack writes into out in out's dtype, even from shards that require grad."""
    layout = PackedDim0Layout.from_specs([("w", (3,))], world_size=2)
    out = torch.full((2,), 5.0, dtype=torch.bfloat16)
    shard = torch.tensor([2.0], requires_grad=True)
    assert layout.pack([shard], 1, out) is out
    assert out.tolist() == [2.0, 0.0]
    assert not out.requires_grad


def test_shard_views_alias_the_packed_buffer() -> None:
    """shard_views exposes each parameter's unpadded shard as a view of the packed buffer."""
    layout = _layout()
    packed = layout.shard(_params(), 1)
    a, b, c = layout.shard_views(packed, 1)
    assert a.tolist() == [[4.0, 5.0], [6.0, 7.0]]
    assert b.tolist() == [101.0]
    assert c.shape == (1, 2, 4)
    assert c.data_ptr() == packed.data_ptr() + 5 * packed.element_size()
    b[0] = -1.0
    assert packed[4].item() == -1.0


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_packed_all_gather_round_trips(world_size: int) -> None:
    """Packing every rank, concatenating (the all-gather) and unpacking gives the parameters."""
    params = _params()
    layout = PackedDim0Layout.from_tensors(zip("abc", params, strict=True), world_size)
    gathered = torch.cat([layout.shard(params, r) for r in range(world_size)])
    full = layout.unpack(gathered)
    for got, want in zip(full, params, strict=True):
        assert torch.equal(got, want)


def test_unpack_into_out_buffers() -> None:
    """unpack copies into the given padded buffers and returns views of their first rows."""
    params = _params()
    layout = _layout()
    gathered = torch.cat([layout.shard(params, r) for r in range(4)])
    out = [torch.empty(4 * n) for n in layout.shard_numels]
    full = layout.unpack(gathered, out)
    for got, want, buf in zip(full, params, out, strict=True):
        assert torch.equal(got, want)
        assert got.data_ptr() == buf.data_ptr()
    assert out[0].tolist()[10:] == [0.0] * 6


def test_unpack_without_out_copies_several_parameters() -> None:
    """With several parameters over several ranks, unpack's results do not alias the input."""
    layout = _layout()
    gathered = torch.cat([layout.shard(_params(), r) for r in range(4)])
    full = layout.unpack(gathered)
    full[0][0, 0] = -1.0
    assert gathered[0].item() == 0.0


def test_unpack_single_parameter_is_zero_copy() -> None:
    """One parameter's gathered buffer is already its padded full tensor: unpack is a view."""
    full = torch.arange(10.0).view(5, 2)
    layout = PackedDim0Layout.from_specs([("w", (5, 2))], world_size=3)
    gathered = torch.cat([layout.shard([full], r) for r in range(3)])
    (unpacked,) = layout.unpack(gathered)
    assert torch.equal(unpacked, full)
    assert unpacked.data_ptr() == gathered.data_ptr()


def test_unpack_world_size_one_is_zero_copy() -> None:
    """On one rank every parameter is contiguous in the buffer: unpack returns views."""
    params = _params()
    layout = PackedDim0Layout.from_tensors(zip("abc", params, strict=True), world_size=1)
    gathered = layout.shard(params, 0)
    full = layout.unpack(gathered)
    assert [t.data_ptr() - gathered.data_ptr() for t in full] == [0, 40, 52]
    for got, want in zip(full, params, strict=True):
        assert torch.equal(got, want)


def test_unpack_accepts_the_gathered_matrix_shape() -> None:
    """A (world_size, per_rank_numel) all-gather output unpacks like the flat one."""
    params = _params()
    layout = _layout()
    gathered = torch.stack([layout.shard(params, r) for r in range(4)])
    assert torch.equal(layout.unpack(gathered)[2], params[2])


def test_packed_layout_with_empty_parameter() -> None:
    """A parameter with zero rows takes no room and unpacks to an empty tensor."""
    layout = PackedDim0Layout.from_specs([("empty", (0, 3)), ("w", (2,))], world_size=2)
    assert layout.shard_numels == (0, 1)
    gathered = torch.cat(
        [layout.shard([torch.empty(0, 3), torch.tensor([1.0, 2.0])], r) for r in range(2)]
    )
    empty, w = layout.unpack(gathered)
    assert empty.shape == (0, 3)
    assert w.tolist() == [1.0, 2.0]


def test_packed_layout_from_specs_equals_from_tensors() -> None:
    """Shapes alone give the same packed layout as the tensors."""
    specs = [("a", (5, 2)), ("b", (3,)), ("c", (3, 2, 4))]
    assert PackedDim0Layout.from_specs(specs, 4) == _layout()
