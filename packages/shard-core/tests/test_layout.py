"""Tests of the flat layout: offsets, padding, shard ranges, metadata and data movement."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shard_core
from shard_core import FlatLayout, ParamShardInfo, ParamSpec, ShardMetadata


def _three_linears() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(10, 10, bias=False),
        nn.ReLU(),
        nn.Linear(10, 10, bias=False),
        nn.ReLU(),
        nn.Linear(10, 10, bias=False),
    )


def _aligned() -> FlatLayout:
    """Numels 3, 5 and 1 (a 0-d parameter) aligned to 4: offsets 0, 4, 12; total 13."""
    return FlatLayout.from_specs(
        [("a", (3,)), ("b", (5,)), ("c", ())], dtype=torch.float32, device="cpu", alignment=4
    )


def _aligned_tensors() -> list[torch.Tensor]:
    return [torch.tensor([1.0, 2.0, 3.0]), torch.arange(10.0, 15.0), torch.tensor(99.0)]


def test_range_metadata_matches_issue_example() -> None:
    """Inclusive range [50, 149] of three 10x10 weights: 0.weight[50..99] and 2.weight[0..49]."""
    layout = FlatLayout.from_tensors(_three_linears().named_parameters())
    meta = layout.range_metadata(range(50, 150))
    assert meta.param_names == ("0.weight", "2.weight")
    assert meta.param_offsets == ((50, 99), (0, 49))
    assert meta.param_shapes == ((10, 10), (10, 10))
    assert meta.param_numels == (100, 100)
    assert [p.offset_in_range for p in meta.params] == [0, 50]
    assert [p.index for p in meta.params] == [0, 1]
    assert meta.numel_in_params == 100


def test_offsets_without_alignment_are_back_to_back() -> None:
    """With alignment 1, each parameter starts where the previous one ends."""
    layout = FlatLayout.from_tensors(_three_linears().named_parameters())
    assert layout.offsets == (0, 100, 200)
    assert layout.total_numel == 300
    assert layout.names == ("0.weight", "2.weight", "4.weight")
    assert layout.dtype == torch.float32
    assert layout.device == torch.device("cpu")


def test_alignment_pads_between_parameters_only() -> None:
    """Each parameter starts at a multiple of the alignment; no padding follows the last one."""
    layout = _aligned()
    assert layout.offsets == (0, 4, 12)
    assert layout.total_numel == 13


def test_shard_and_padded_numel_round_up_to_world_size() -> None:
    """shard_numel is ceil(total / world_size) and padded_numel is world_size times that."""
    layout = _aligned()
    sizes = {ws: (layout.shard_numel(ws), layout.padded_numel(ws)) for ws in (1, 2, 3, 4, 13, 14)}
    assert sizes == {1: (13, 13), 2: (7, 14), 3: (5, 15), 4: (4, 16), 13: (1, 13), 14: (1, 14)}


def test_shard_range_is_the_ranks_slice_of_the_padded_buffer() -> None:
    """Rank r of N owns [r * shard_numel, (r + 1) * shard_numel), reaching into tail padding."""
    layout = _aligned()
    ranges = [layout.shard_range(r, 3) for r in range(3)]
    assert ranges == [range(0, 5), range(5, 10), range(10, 15)]


def test_shard_metadata_skips_alignment_padding() -> None:
    """Metadata per rank names only parameter elements, with inclusive in-parameter offsets."""
    layout = _aligned()
    metas = [layout.shard_metadata(r, 3) for r in range(3)]
    assert metas[0] == ShardMetadata(
        range(0, 5),
        (
            ParamShardInfo(0, "a", (3,), 3, start=0, end=2, offset_in_range=0),
            ParamShardInfo(1, "b", (5,), 5, start=0, end=0, offset_in_range=4),
        ),
    )
    assert metas[1] == ShardMetadata(
        range(5, 10), (ParamShardInfo(1, "b", (5,), 5, start=1, end=4, offset_in_range=0),)
    )
    assert metas[2] == ShardMetadata(
        range(10, 15), (ParamShardInfo(2, "c", (), 1, start=0, end=0, offset_in_range=2),)
    )


def test_range_inside_alignment_padding_has_no_parameters() -> None:
    """A range made only of alignment padding (elements 3 and 8..11) has no metadata entries."""
    layout = _aligned()
    assert layout.range_metadata(range(3, 4)).params == ()
    assert layout.range_metadata(range(9, 12)).params == ()
    assert layout.range_metadata(range(2, 5)).param_offsets == ((2, 2), (0, 0))


def test_rank_entirely_in_alignment_padding() -> None:
    """Two 1-element parameters aligned to 4 over 4 ranks leave ranks 1 and 3 with only padding."""
    layout = FlatLayout.from_specs(
        [("x", (1,)), ("y", (1,))], dtype=torch.float32, device="cpu", alignment=4
    )
    assert layout.total_numel == 5
    names = [layout.shard_metadata(r, 4).param_names for r in range(4)]
    assert names == [("x",), (), ("y",), ()]
    flat = torch.tensor([7.0, 0.0, 0.0, 0.0, 8.0])
    shards = [layout.shard(flat, r, 4).tolist() for r in range(4)]
    assert shards == [[7.0, 0.0], [0.0, 0.0], [8.0, 0.0], [0.0, 0.0]]
    assert layout.shard_views(torch.zeros(2), 1, 4) == ()


def test_rank_entirely_in_tail_padding() -> None:
    """Ten elements over eight ranks: ranks 5 to 7 hold only zeros and no parameters."""
    layout = FlatLayout.from_specs([("w", (10,))], dtype=torch.float32, device="cpu")
    assert layout.shard_numel(8) == 2
    for rank in (5, 6, 7):
        assert layout.shard_metadata(rank, 8).params == ()
        assert layout.shard(torch.arange(1.0, 11.0), rank, 8).tolist() == [0.0, 0.0]
    assert layout.shard_metadata(4, 8).param_offsets == ((8, 9),)


def test_flatten_writes_zeros_into_padding() -> None:
    """flatten lays parameters at their offsets with zero alignment padding."""
    flat = _aligned().flatten(_aligned_tensors())
    expected = [1.0, 2.0, 3.0, 0.0, 10.0, 11.0, 12.0, 13.0, 14.0, 0.0, 0.0, 0.0, 99.0]
    assert flat.tolist() == expected
    assert flat.dtype == torch.float32


def test_flatten_with_world_size_pads_the_tail() -> None:
    """flatten(world_size=N) returns padded_numel(N) elements, zero at the end."""
    flat = _aligned().flatten(_aligned_tensors(), world_size=3)
    assert flat.numel() == 15
    assert flat[13:].tolist() == [0.0, 0.0]


def test_flatten_puts_zeros_for_missing_tensors() -> None:
    """A None entry (a gradient that was never computed) flattens to zeros of its numel."""
    flat = _aligned().flatten([None, torch.arange(10.0, 15.0), None])
    assert flat.tolist() == [0.0] * 4 + [10.0, 11.0, 12.0, 13.0, 14.0] + [0.0] * 4


def test_flatten_of_only_missing_tensors_uses_layout_dtype() -> None:
    """With every entry None, the buffer takes the layout's dtype and device."""
    layout = FlatLayout.from_specs([("w", (2,))], dtype=torch.float64, device="cpu")
    flat = layout.flatten([None])
    assert flat.dtype == torch.float64
    assert flat.tolist() == [0.0, 0.0]


def test_flatten_into_out_casts_and_returns_out() -> None:
    """flatten(out=...) fills the given buffer in its dtype and returns that same tensor."""
    out = torch.full((15,), 5.0, dtype=torch.bfloat16)
    result = _aligned().flatten(_aligned_tensors(), out, world_size=3)
    assert result is out
    assert out.dtype == torch.bfloat16
    expected = [1.0, 2.0, 3.0, 0.0, 10.0, 11.0, 12.0, 13.0, 14.0, 0.0, 0.0, 0.0, 99.0, 0.0, 0.0]
    assert out.tolist() == expected


def test_views_alias_flat_in_original_shapes() -> None:
    """views are zero-copy views at each parameter's offset, in its shape, writing through."""
    layout = _aligned()
    flat = layout.flatten(_aligned_tensors())
    a, b, c = layout.views(flat)
    assert (a.shape, b.shape, c.shape) == ((3,), (5,), ())
    item = flat.element_size()
    assert [v.data_ptr() - flat.data_ptr() for v in (a, b, c)] == [0, 4 * item, 12 * item]
    b[1] = -1.0
    assert flat[5].item() == -1.0


def test_views_of_padded_gathered_buffer() -> None:
    """views accept a buffer longer than total_numel (an all-gather output) and ignore the tail."""
    layout = FlatLayout.from_tensors(_three_linears().named_parameters())
    gathered = torch.arange(float(layout.padded_numel(7)))
    assert gathered.numel() == 301
    views = layout.views(gathered)
    assert [v.shape for v in views] == [(10, 10)] * 3
    assert views[2][9, 9].item() == 299.0


def test_views_carry_gradients_back_to_flat() -> None:
    """Autograd through the views accumulates into the flat parameter, zero on padding."""
    layout = _aligned()
    flat = nn.Parameter(layout.flatten(_aligned_tensors()))
    a, b, c = layout.views(flat)
    (a.sum() + 2 * b.sum() + 3 * c).backward()
    assert flat.grad is not None
    assert flat.grad.tolist() == [1.0] * 3 + [0.0] + [2.0] * 5 + [0.0] * 3 + [3.0]


def test_shard_from_flat_equals_shard_from_tensors() -> None:
    """Sharding the flat buffer and sharding the parameters directly give the same shards."""
    layout = _aligned()
    tensors = _aligned_tensors()
    flat = layout.flatten(tensors)
    expected = [
        [1.0, 2.0, 3.0, 0.0, 10.0],
        [11.0, 12.0, 13.0, 14.0, 0.0],
        [0.0, 0.0, 99.0, 0.0, 0.0],
    ]
    assert [layout.shard(flat, r, 3).tolist() for r in range(3)] == expected
    assert [layout.shard(tensors, r, 3).tolist() for r in range(3)] == expected


def test_shard_zeroes_padding_whatever_the_input_holds() -> None:
    """Garbage in a flat buffer's padding never reaches a shard."""
    layout = _aligned()
    flat = torch.full((15,), -7.0)
    flat[layout.offsets[2]] = 99.0
    assert layout.shard(flat, 2, 3).tolist() == [0.0, 0.0, 99.0, 0.0, 0.0]
    assert layout.shard(flat, 0, 3).tolist() == [-7.0, -7.0, -7.0, 0.0, -7.0]


def test_shard_never_aliases_its_input() -> None:
    """A shard owns its storage, so the full buffer can be freed after sharding."""
    layout = FlatLayout.from_specs([("w", (8,))], dtype=torch.float32, device="cpu")
    flat = torch.arange(8.0)
    shard = layout.shard(flat, 0, 2)
    shard[0] = 100.0
    assert flat[0].item() == 0.0


def test_shard_into_out_casts_and_returns_out() -> None:
    """shard(out=...) writes the rank's elements into the given buffer and returns it."""
    out = torch.full((5,), 3.0, dtype=torch.float64)
    result = _aligned().shard(_aligned_tensors(), 1, 3, out)
    assert result is out
    assert out.tolist() == [11.0, 12.0, 13.0, 14.0, 0.0]


def test_shard_views_hold_each_parameters_elements() -> None:
    """shard_views returns, per metadata entry, the 1-D view of that parameter's elements."""
    layout = _aligned()
    shard = layout.shard(_aligned_tensors(), 0, 3)
    views = layout.shard_views(shard, 0, 3)
    assert [v.tolist() for v in views] == [[1.0, 2.0, 3.0], [10.0]]
    assert views[1].data_ptr() == shard.data_ptr() + 4 * shard.element_size()


def test_from_specs_equals_from_tensors() -> None:
    """A layout built from names and shapes equals the one built from the tensors."""
    model = _three_linears()
    from_tensors = FlatLayout.from_tensors(dict(model.named_parameters()), alignment=8)
    from_specs = FlatLayout.from_specs(
        [ParamSpec("0.weight", (10, 10)), ("2.weight", [10, 10]), ("4.weight", (10, 10))],
        dtype=torch.float32,
        device=torch.device("cpu"),
        alignment=8,
    )
    assert from_tensors == from_specs
    assert from_tensors.offsets == (0, 104, 208)


def test_meta_device_layout_plans_without_data() -> None:
    """Meta tensors give a full layout, and flatten/shard run on meta without allocating data."""
    with torch.device("meta"):
        model = _three_linears()
    layout = FlatLayout.from_tensors(model.named_parameters())
    assert layout.device == torch.device("meta")
    params = list(model.parameters())
    assert layout.flatten(params, world_size=4).shape == (300,)
    assert layout.shard(params, 3, 4).device == torch.device("meta")


def test_metadata_for_thousands_of_ranks_covers_each_element_once() -> None:
    """Across 4096 ranks the metadata accounts for every parameter element exactly once."""
    layout = FlatLayout.from_specs(
        [(f"layers.{i}.weight", (4096, 1024)) for i in range(4)],
        dtype=torch.bfloat16,
        device="meta",
        alignment=16,
    )
    covered = [0] * len(layout.params)
    for rank in range(4096):
        for info in layout.shard_metadata(rank, 4096).params:
            covered[info.index] += info.numel_in_range
    assert covered == [4096 * 1024] * 4


def test_zero_numel_parameter_appears_in_no_shard() -> None:
    """A parameter with no elements gets an offset but never shows up in metadata."""
    layout = FlatLayout.from_specs(
        [("empty", (0, 3)), ("w", (2,))], dtype=torch.float32, device="cpu"
    )
    assert layout.offsets == (0, 0)
    assert layout.shard_metadata(0, 1).param_names == ("w",)
    assert [v.shape for v in layout.views(torch.arange(2.0))] == [(0, 3), (2,)]


def test_unit_of_only_empty_parameters_shards_to_nothing() -> None:
    """A unit whose parameters hold no elements has empty shards on every rank."""
    layout = FlatLayout.from_specs([("empty", (0,))], dtype=torch.float32, device="cpu")
    assert layout.total_numel == 0
    assert layout.shard([torch.empty(0)], 1, 2).shape == (0,)


def test_repr_summarizes_the_layout() -> None:
    """The repr stays one short line however many parameters the unit has."""
    assert repr(_aligned()) == (
        "FlatLayout(3 params, total_numel=13, dtype=torch.float32, device=cpu, alignment=4)"
    )


def test_layout_names_are_exported_from_shard_core() -> None:
    """The flat-layout and dim-0 names are part of shard_core's public, sorted __all__."""
    names = {
        "FlatLayout",
        "ParamShardInfo",
        "ParamSpec",
        "ShardMetadata",
        "dim0_chunk_range",
        "padded_dim0_size",
    }
    assert names <= set(shard_core.__all__)
    assert all(getattr(shard_core, name) is not None for name in names)
    assert list(shard_core.__all__) == sorted(shard_core.__all__)


@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
def test_gathered_shards_view_as_the_parameters(world_size: int) -> None:
    """Concatenating every rank's shard rebuilds a buffer whose views equal the parameters."""
    layout = _aligned()
    tensors = _aligned_tensors()
    gathered = torch.cat([layout.shard(tensors, r, world_size) for r in range(world_size)])
    assert gathered.numel() == layout.padded_numel(world_size)
    for view, tensor in zip(layout.views(gathered), tensors, strict=True):
        assert torch.equal(view, tensor)
