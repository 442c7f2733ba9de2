"""Input checks shared by the flat layout and dim-0 sharding.

Each check raises :class:`~shard_core.errors.LayoutError` with a message that
names the parameter at fault, the value seen and what to do instead, so a user
who wraps the wrong thing learns the fix from the first line of the traceback.
The checks look at metadata only (dtype, device, shape, strides): they never
touch tensor data, so they run on meta tensors and cost nothing per element.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from shard_core.errors import LayoutError

__all__ = [
    "check_alignment",
    "check_floating_dtype",
    "check_not_empty",
    "check_rank",
    "check_unique_names",
    "check_unit_tensors",
    "check_world_size",
    "fmt_shape",
]


def fmt_shape(shape: Iterable[int]) -> str:
    """Write a shape as a plain tuple, ``(10, 10)`` or ``()``, never ``torch.Size([...])``."""
    dims = tuple(int(d) for d in shape)
    return str(dims)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_alignment(alignment: int) -> None:
    """Reject an alignment that is not a positive number of elements."""
    if not _is_int(alignment) or alignment < 1:
        raise LayoutError(
            f"alignment must be an integer >= 1 (a number of elements), got {alignment!r}: "
            "use 1 for no padding between parameters"
        )


def check_world_size(world_size: int) -> None:
    """Reject a world size that is not a positive integer."""
    if not _is_int(world_size) or world_size < 1:
        raise LayoutError(f"world_size must be an integer >= 1, got {world_size!r}")


def check_rank(rank: int, world_size: int) -> None:
    """Reject a world size below 1 or a rank outside ``[0, world_size)``."""
    check_world_size(world_size)
    if not _is_int(rank) or not 0 <= rank < world_size:
        raise LayoutError(
            f"rank {rank!r} is out of range for world_size {world_size}: "
            f"use a rank in [0, {world_size - 1}]"
        )


def check_floating_dtype(name: str, dtype: torch.dtype) -> None:
    """Reject a non floating-point dtype for parameter ``name``."""
    if not dtype.is_floating_point:
        raise LayoutError(
            f"parameter {name!r} has dtype {dtype}, but shard lays out floating-point "
            "parameters only: convert it to a floating dtype, or register it as a buffer "
            "if it is not trained"
        )


def check_not_empty(count: int) -> None:
    """Reject a unit of ``count == 0`` parameters."""
    if count == 0:
        raise LayoutError(
            "cannot lay out a unit with no parameters: pass at least one parameter, "
            "or do not make a unit of a module that has no parameters"
        )


def check_unique_names(names: Iterable[str]) -> None:
    """Reject a unit that lists one qualified name twice."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise LayoutError(
                f"parameter name {name!r} appears twice in one unit: give each parameter "
                "once, under one qualified name"
            )
        seen.add(name)


def check_unit_tensors(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Check the parameters of one unit before they are laid out together.

    A unit needs at least one parameter; every parameter must be a dense,
    contiguous, floating-point tensor; all must share one dtype and one
    device; each must appear once (by name and by identity: a tied weight
    listed twice would be sharded as two copies and silently untied).
    """
    check_not_empty(len(named_tensors))
    check_unique_names(name for name, _ in named_tensors)
    first_name, first = named_tensors[0]
    by_identity: dict[int, str] = {}
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise LayoutError(
                f"parameter {name!r} is a {type(tensor).__name__}, not a torch.Tensor: "
                "pass (name, tensor) pairs, e.g. module.named_parameters()"
            )
        check_floating_dtype(name, tensor.dtype)
        if tensor.dtype != first.dtype:
            raise LayoutError(
                f"parameters {first_name!r} ({first.dtype}) and {name!r} ({tensor.dtype}) "
                "have different dtypes, but one unit holds one dtype: cast them to one dtype "
                "(e.g. module.to(torch.float32)) or put them in different units"
            )
        if tensor.device != first.device:
            raise LayoutError(
                f"parameters {first_name!r} ({first.device}) and {name!r} ({tensor.device}) "
                "are on different devices, but one unit lives on one device: move them to "
                "one device (e.g. module.to(device)) or put them in different units"
            )
        if tensor.layout != torch.strided:
            raise LayoutError(
                f"parameter {name!r} has layout {tensor.layout}; shard lays out dense "
                "(torch.strided) parameters only: convert it with .to_dense()"
            )
        if not tensor.is_contiguous():
            raise LayoutError(
                f"parameter {name!r} is not contiguous (shape {fmt_shape(tensor.shape)}, "
                f"stride {fmt_shape(tensor.stride())}); shard lays parameters out densely: "
                "call .contiguous() on it first, e.g. param.data = param.data.contiguous()"
            )
        other = by_identity.setdefault(id(tensor), name)
        if other != name:
            raise LayoutError(
                f"parameters {other!r} and {name!r} are the same tensor (a shared or tied "
                "weight): list it once, under one name, so that it stays shared"
            )
