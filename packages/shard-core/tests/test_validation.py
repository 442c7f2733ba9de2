"""Tests of the errors bad layout input raises: each names the culprit and the fix."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from shard_core import FlatLayout, ParamSpec, dim0_chunk_range, padded_dim0_size
from shard_core.errors import LayoutError, ShardError


def _exact(message: str) -> str:
    return "^" + re.escape(message) + "$"


def _aligned() -> FlatLayout:
    return FlatLayout.from_specs(
        [("a", (3,)), ("b", (5,)), ("c", ())], dtype=torch.float32, device="cpu", alignment=4
    )


def test_layout_error_is_a_value_error() -> None:
    """LayoutError can be caught as ShardError and as ValueError."""
    with pytest.raises(ValueError, match="no parameters") as info:
        FlatLayout.from_tensors([])
    assert isinstance(info.value, ShardError)


def test_empty_unit_is_rejected() -> None:
    """The flat layout refuses a unit with no parameters."""
    message = (
        "cannot lay out a unit with no parameters: pass at least one parameter, "
        "or do not make a unit of a module that has no parameters"
    )
    with pytest.raises(LayoutError, match=_exact(message)):
        FlatLayout.from_tensors({})


def test_empty_specs_are_rejected() -> None:
    """A layout from no specs is refused like one from no tensors."""
    with pytest.raises(LayoutError, match=r"^cannot lay out a unit with no parameters"):
        FlatLayout.from_specs([], dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.uint8, torch.complex64])
def test_non_floating_parameter_is_named(dtype: torch.dtype) -> None:
    """An integer, bool or complex parameter is refused with its name and dtype."""
    named = [("w", torch.zeros(2)), ("steps", torch.zeros(2, dtype=dtype))]
    message = (
        f"parameter 'steps' has dtype {dtype}, but shard lays out floating-point parameters "
        "only: convert it to a floating dtype, or register it as a buffer if it is not trained"
    )
    with pytest.raises(LayoutError, match=_exact(message)):
        FlatLayout.from_tensors(named)


def test_non_floating_spec_dtype_is_named() -> None:
    """A metadata-only layout with an integer dtype names its first parameter."""
    with pytest.raises(LayoutError, match=r"^parameter 'a' has dtype torch\.int32, but shard"):
        FlatLayout.from_specs([("a", (2,))], dtype=torch.int32, device="cpu")


def test_mixed_dtypes_name_both_parameters() -> None:
    """Two dtypes in one unit: both parameters and both dtypes are named."""
    named = [("0.weight", torch.zeros(2)), ("2.weight", torch.zeros(2, dtype=torch.float16))]
    message = (
        "parameters '0.weight' (torch.float32) and '2.weight' (torch.float16) have different "
        "dtypes, but one unit holds one dtype: cast them to one dtype (e.g. "
        "module.to(torch.float32)) or put them in different units"
    )
    with pytest.raises(LayoutError, match=_exact(message)):
        FlatLayout.from_tensors(named)


def test_mixed_devices_name_both_parameters() -> None:
    """Two devices in one unit: both parameters and both devices are named."""
    named = [("a", torch.zeros(2)), ("b", torch.zeros(2, device="meta"))]
    message = (
        "parameters 'a' (cpu) and 'b' (meta) are on different devices, but one unit lives on "
        "one device: move them to one device (e.g. module.to(device)) or put them in "
        "different units"
    )
    with pytest.raises(LayoutError, match=_exact(message)):
        FlatLayout.from_tensors(named)


def test_zero_dim_parameter_is_fine_in_a_flat_unit() -> None:
    """A flat unit lays a 0-d parameter out as one element and views it back as 0-d."""
    layout = FlatLayout.from_tensors([("scale", torch.tensor(2.0))])
    assert layout.total_numel == 1
    assert layout.views(torch.tensor([2.0]))[0].shape == ()


def test_non_contiguous_parameter_is_named() -> None:
    """A transposed parameter is refused with its shape, strides and the .contiguous() fix."""
    named = [("proj.weight", torch.zeros(4, 3).t())]
    message = (
        "parameter 'proj.weight' is not contiguous (shape (3, 4), stride (1, 3)); shard lays "
        "parameters out densely: call .contiguous() on it first, e.g. "
        "param.data = param.data.contiguous()"
    )
    with pytest.raises(LayoutError, match=_exact(message)):
        FlatLayout.from_tensors(named)


def test_sparse_parameter_is_named() -> None:
    """A sparse tensor is refused before its contiguity is asked."""
    named = [("emb", torch.zeros(2, 2).to_sparse())]
    message = (
        "parameter 'emb' has layout torch.sparse_coo; shard lays out dense (torch.strided) "
        "parameters only: convert it with .to_dense()"
    )
    with pytest.raises(LayoutError, match=_exact(message)):
        FlatLayout.from_tensors(named)


def test_duplicate_name_is_rejected() -> None:
    """One qualified name listed twice is refused."""
    message = (
        "parameter name 'w' appears twice in one unit: give each parameter once, "
        "under one qualified name"
    )
    with pytest.raises(LayoutError, match=_exact(message)):
        FlatLayout.from_specs([("w", (2,)), ("w", (3,))], dtype=torch.float32, device="cpu")


def test_tied_parameter_listed_twice_is_rejected() -> None:
    """The same tensor under two names (a tied weight) is refused, naming both."""
    shared = nn.Parameter(torch.zeros(4, 2))
    message = (
        "parameters 'embed.weight' and 'head.weight' are the same tensor (a shared or tied "
        "weight): list it once, under one name, so that it stays shared"
    )
    with pytest.raises(LayoutError, match=_exact(message)):
        FlatLayout.from_tensors([("embed.weight", shared), ("head.weight", shared)])


def test_non_tensor_is_named() -> None:
    """Something that is not a tensor is refused with its name and type."""
    message = (
        "parameter 'w' is a list, not a torch.Tensor: pass (name, tensor) pairs, "
        "e.g. module.named_parameters()"
    )
    with pytest.raises(LayoutError, match=_exact(message)):
        FlatLayout.from_tensors([("w", [1.0, 2.0])])  # type: ignore[list-item]


def test_negative_dim_in_spec_is_named() -> None:
    """A spec with a negative dim is refused with the parameter's name."""
    message = "parameter 'w' has shape (2, -1): every dim must be an integer >= 0"
    with pytest.raises(LayoutError, match=_exact(message)):
        ParamSpec("w", (2, -1))


def test_constructor_requires_param_specs() -> None:
    """The dataclass constructor points (name, shape) pairs to from_specs."""
    with pytest.raises(LayoutError, match=r"^FlatLayout\(params=\.\.\.\) takes ParamSpec"):
        FlatLayout((("w", (2,)),), torch.float32, torch.device("cpu"))  # type: ignore[arg-type]


@pytest.mark.parametrize("alignment", [0, -4, 1.5, True])
def test_alignment_below_one_is_rejected(alignment: object) -> None:
    """An alignment that is not a positive integer is refused with the value seen."""
    message = (
        f"alignment must be an integer >= 1 (a number of elements), got {alignment!r}: "
        "use 1 for no padding between parameters"
    )
    with pytest.raises(LayoutError, match=_exact(message)):
        FlatLayout.from_specs(
            [("w", (2,))],
            dtype=torch.float32,
            device="cpu",
            alignment=alignment,  # type: ignore[arg-type]
        )


@pytest.mark.parametrize("world_size", [0, -1])
def test_world_size_below_one_is_rejected(world_size: int) -> None:
    """Every world-size argument refuses values below 1."""
    message = f"world_size must be an integer >= 1, got {world_size}"
    layout = _aligned()
    with pytest.raises(LayoutError, match=_exact(message)):
        layout.shard_numel(world_size)
    with pytest.raises(LayoutError, match=_exact(message)):
        layout.shard_metadata(0, world_size)
    with pytest.raises(LayoutError, match=_exact(message)):
        padded_dim0_size(4, world_size)


@pytest.mark.parametrize("rank", [-1, 4])
def test_rank_out_of_range_is_rejected(rank: int) -> None:
    """A rank outside [0, world_size) is refused with the valid range."""
    message = f"rank {rank} is out of range for world_size 4: use a rank in [0, 3]"
    layout = _aligned()
    with pytest.raises(LayoutError, match=_exact(message)):
        layout.shard_range(rank, 4)
    with pytest.raises(LayoutError, match=_exact(message)):
        layout.shard(torch.zeros(13), rank, 4)
    with pytest.raises(LayoutError, match=_exact(message)):
        dim0_chunk_range(4, rank, 4)


def test_bad_range_is_rejected() -> None:
    """range_metadata needs a forward, step-1 range of non-negative elements."""
    message = "flat_range must have step 1 and 0 <= start <= stop, got range(0, 10, 2)"
    with pytest.raises(LayoutError, match=_exact(message)):
        _aligned().range_metadata(range(0, 10, 2))
    with pytest.raises(LayoutError, match=r"got range\(-1, 3\)$"):
        _aligned().range_metadata(range(-1, 3))


def test_flatten_wrong_count_is_rejected() -> None:
    """flatten needs one tensor per parameter."""
    message = (
        "flatten got 2 tensors for a layout of 3 parameters: pass one per parameter, "
        "in layout order"
    )
    with pytest.raises(LayoutError, match=_exact(message)):
        _aligned().flatten([torch.zeros(3), torch.zeros(5)])


def test_flatten_wrong_shape_names_the_parameter() -> None:
    """A tensor of the wrong shape is refused with the parameter's name and both shapes."""
    message = "flatten got a tensor of shape (4,) for parameter 'b', whose shape is (5,)"
    with pytest.raises(LayoutError, match=_exact(message)):
        _aligned().flatten([torch.zeros(3), torch.zeros(4), torch.tensor(0.0)])


def test_flatten_wrong_out_is_rejected() -> None:
    """flatten's out must be contiguous, 1-D and exactly the size asked for."""
    tensors = [torch.zeros(3), torch.zeros(5), torch.tensor(0.0)]
    message = "flatten needs out to be a contiguous 1-D tensor of 15 elements, got shape (13,)"
    with pytest.raises(LayoutError, match=_exact(message)):
        _aligned().flatten(tensors, torch.zeros(13), world_size=3)
    strided = torch.zeros(26)[::2]
    with pytest.raises(LayoutError, match=r"got shape \(13,\) \(not contiguous\)$"):
        _aligned().flatten(tensors, strided)


def test_views_of_short_buffer_is_rejected() -> None:
    """views needs at least total_numel elements in a 1-D buffer."""
    message = "views needs a 1-D buffer of at least total_numel=13 elements, got shape (12,)"
    with pytest.raises(LayoutError, match=_exact(message)):
        _aligned().views(torch.zeros(12))


def test_shard_of_short_buffer_is_rejected() -> None:
    """shard needs a flat buffer of at least total_numel elements."""
    message = (
        "shard needs a 1-D flat buffer of at least total_numel=13 elements, or one tensor "
        "per parameter; got shape (2, 6)"
    )
    with pytest.raises(LayoutError, match=_exact(message)):
        _aligned().shard(torch.zeros(2, 6), 0, 2)


def test_shard_views_of_wrong_size_is_rejected() -> None:
    """shard_views needs exactly the rank's shard."""
    message = "shard_views needs rank 1's 1-D shard of shard_numel=5 elements (world_size 3), "
    with pytest.raises(LayoutError, match="^" + re.escape(message) + r"got shape \(6,\)$"):
        _aligned().shard_views(torch.zeros(6), 1, 3)


def test_dim0_negative_is_rejected() -> None:
    """A negative dim-0 size is refused."""
    message = "dim0 must be an integer >= 0 (a number of rows), got -1"
    with pytest.raises(LayoutError, match=_exact(message)):
        padded_dim0_size(-1, 2)
