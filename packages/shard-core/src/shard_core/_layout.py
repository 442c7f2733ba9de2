"""The flat layout of a unit: where each parameter lives in one 1-D buffer.

The wrapper front end (``FullyShardedDataParallel``) communicates a unit as
one flat buffer, so it needs to know, for any world size, where every
parameter starts, which elements are padding, which elements each rank owns
and which parameters a rank's shard touches. :class:`FlatLayout` answers all
of that from names and shapes alone (meta-device planning for thousands of
ranks never allocates), and moves data with one ``torch.cat`` per call,
into a buffer the caller preallocated when it has one.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from shard_core._validate import (
    check_alignment,
    check_floating_dtype,
    check_not_empty,
    check_rank,
    check_unique_names,
    check_unit_tensors,
    check_world_size,
    fmt_shape,
)
from shard_core.errors import LayoutError

__all__ = ["FlatLayout", "ParamShardInfo", "ParamSpec", "ShardMetadata", "ceil_div"]

_T = TypeVar("_T")

# [Note: Flat layout]
# A unit's parameters lie back to back in one 1-D buffer, in the order given:
#
#   | p0 |pad| p1 |pad| p2 |  tail padding  |
#   0        ^offsets[1]   ^total_numel     ^padded_numel(N)
#
# Parameter i starts at offsets[i], the first multiple of `alignment` at or after
# the end of parameter i-1 (no padding between parameters when alignment is 1).
# total_numel is the end of the last parameter. For N ranks the buffer is padded
# at the end to padded_numel(N) = N * shard_numel(N), shard_numel(N) =
# ceil(total_numel / N), and rank r owns [r * shard_numel, (r + 1) * shard_numel).
# A rank's range may cut parameters anywhere or lie entirely in padding.
# Padding elements are zero, belong to no parameter, and appear in no metadata
# and no view: they never reach the user.
#
# [Note: One copy per call]
# flatten and shard build a list of 1-D pieces (parameter data, and slices of
# one zero tensor for the padding) and write them with a single torch.cat,
# into `out` when the caller has a buffer. torch.cat casts to out's dtype, so
# flattening fp32 gradients into a bf16 reduce buffer is the same one copy.
# flatten records autograd when out is None (a flat parameter built from
# parameters is then differentiable; detach it or call under torch.no_grad()
# to get a leaf); with out=, its inputs must not require grad. shard is data
# movement only: its result never requires grad.


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` in integers (exact for any size; ``math.ceil(a / b)`` rounds above 2**53)."""
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter as the layout sees it: a qualified name and a shape, no data.

    Attributes:
        name: The parameter's qualified name in its module (``"layers.0.weight"``).
        shape: The parameter's shape; stored as a ``torch.Size``.
        numel: Number of elements, the product of ``shape`` (1 for a 0-d shape).
    """

    name: str
    shape: tuple[int, ...]
    numel: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        dims = tuple(self.shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
            raise LayoutError(
                f"parameter {self.name!r} has shape {dims!r}: every dim must be an integer >= 0"
            )
        size = torch.Size(dims)
        object.__setattr__(self, "shape", size)
        object.__setattr__(self, "numel", math.prod(size))

    @classmethod
    def from_tensor(cls, name: str, tensor: torch.Tensor) -> ParamSpec:
        """The spec of ``tensor`` under ``name``."""
        return cls(name, tuple(tensor.shape))


@dataclass(frozen=True, slots=True)
class ParamShardInfo:
    """The part of one parameter that lies inside a range of the flat buffer.

    Attributes:
        index: The parameter's position in the layout.
        name: The parameter's qualified name.
        shape: The whole parameter's shape.
        numel: The whole parameter's number of elements.
        start: First element inside the range, counted in the flattened parameter.
        end: Last element inside the range (inclusive), counted the same way.
        offset_in_range: Where ``start`` lies relative to the range's first element;
            for a rank's shard, the position of this piece in the shard.
    """

    index: int
    name: str
    shape: tuple[int, ...]
    numel: int
    start: int
    end: int
    offset_in_range: int

    @property
    def offsets(self) -> tuple[int, int]:
        """``(start, end)``, both inclusive."""
        return (self.start, self.end)

    @property
    def numel_in_range(self) -> int:
        """Number of the parameter's elements inside the range."""
        return self.end - self.start + 1


@dataclass(frozen=True, slots=True)
class ShardMetadata:
    """Which parameters a range of the flat buffer holds (usually one rank's shard).

    Attributes:
        flat_range: The range of flat-buffer elements described (half-open, step 1).
        params: One entry per parameter with at least one element in the range, in
            layout order. Padding contributes no entry, so a range that lies entirely
            in padding has none.
    """

    flat_range: range
    params: tuple[ParamShardInfo, ...]

    @property
    def param_names(self) -> tuple[str, ...]:
        """Qualified names of the parameters in the range."""
        return tuple(p.name for p in self.params)

    @property
    def param_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Whole shapes of the parameters in the range."""
        return tuple(p.shape for p in self.params)

    @property
    def param_numels(self) -> tuple[int, ...]:
        """Whole numels of the parameters in the range."""
        return tuple(p.numel for p in self.params)

    @property
    def param_offsets(self) -> tuple[tuple[int, int], ...]:
        """Inclusive ``(start, end)`` element offsets inside each parameter."""
        return tuple(p.offsets for p in self.params)

    @property
    def numel_in_params(self) -> int:
        """Elements of the range that belong to a parameter (the rest is padding)."""
        return sum(p.numel_in_range for p in self.params)


@dataclass(frozen=True, repr=False)
class FlatLayout:
    """Where each parameter of a unit lives in the unit's flat buffer.

    See [Note: Flat layout]. Build one with :meth:`from_tensors` (real or meta
    tensors) or :meth:`from_specs` (names and shapes only). Every method that
    takes ``rank``/``world_size`` works for any world size; nothing here talks
    to a process group.

    Attributes:
        params: The parameters, in flat-buffer order.
        dtype: The dtype of the unit's parameters (floating point).
        device: The device of the unit's parameters.
        alignment: Every parameter starts at a multiple of this many elements; 1 means
            no padding between parameters.
        offsets: Start of each parameter in the flat buffer (derived).
        total_numel: End of the last parameter: parameters plus alignment padding,
            without the tail padding to a multiple of the world size (derived).
    """

    params: tuple[ParamSpec, ...]
    dtype: torch.dtype
    device: torch.device
    alignment: int = 1
    offsets: tuple[int, ...] = field(init=False, compare=False)
    total_numel: int = field(init=False, compare=False)
    # Sizes for one split_with_sizes: numel_0, pad_0, numel_1, pad_1, ..., numel_last.
    _split_sizes: tuple[int, ...] = field(init=False, compare=False)
    _max_gap: int = field(init=False, compare=False)  # largest alignment padding

    def __post_init__(self) -> None:
        params = tuple(self.params)
        if not all(isinstance(p, ParamSpec) for p in params):
            raise LayoutError(
                "FlatLayout(params=...) takes ParamSpec entries: use FlatLayout.from_specs "
                "for (name, shape) pairs, or FlatLayout.from_tensors for tensors"
            )
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "device", torch.device(self.device))
        check_not_empty(len(params))
        check_unique_names(p.name for p in params)
        check_alignment(self.alignment)
        check_floating_dtype(params[0].name, self.dtype)
        offsets: list[int] = []
        sizes: list[int] = []
        end = 0
        for spec in params:
            start = ceil_div(end, self.alignment) * self.alignment
            if offsets:
                sizes.append(start - end)
            offsets.append(start)
            sizes.append(spec.numel)
            end = start + spec.numel
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "total_numel", end)
        object.__setattr__(self, "_split_sizes", tuple(sizes))
        object.__setattr__(self, "_max_gap", max(sizes[1::2], default=0))

    @classmethod
    def from_tensors(
        cls,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        *,
        alignment: int = 1,
    ) -> FlatLayout:
        """The layout of ``named_tensors`` (e.g. ``module.named_parameters()``), in order.

        The tensors must be non-empty in number, floating point, contiguous, of one
        dtype and on one device (meta included); each must appear once.
        """
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        check_unit_tensors(items)
        first = items[0][1]
        return cls(
            tuple(ParamSpec.from_tensor(name, t) for name, t in items),
            first.dtype,
            first.device,
            alignment,
        )

    @classmethod
    def from_specs(
        cls,
        specs: Iterable[ParamSpec | tuple[str, Sequence[int]]],
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        alignment: int = 1,
    ) -> FlatLayout:
        """The layout of parameters given as ``ParamSpec`` or ``(name, shape)`` pairs."""
        params = tuple(
            s if isinstance(s, ParamSpec) else ParamSpec(s[0], tuple(s[1])) for s in specs
        )
        return cls(params, dtype, torch.device(device), alignment)

    def __repr__(self) -> str:
        return (
            f"FlatLayout({len(self.params)} params, total_numel={self.total_numel}, "
            f"dtype={self.dtype}, device={self.device}, alignment={self.alignment})"
        )

    @property
    def names(self) -> tuple[str, ...]:
        """Qualified names of the parameters, in flat-buffer order."""
        return tuple(p.name for p in self.params)

    # - sizes and ranges

    def shard_numel(self, world_size: int) -> int:
        """Elements each rank holds: ``ceil(total_numel / world_size)``."""
        check_world_size(world_size)
        return ceil_div(self.total_numel, world_size)

    def padded_numel(self, world_size: int) -> int:
        """Flat-buffer size padded at the end to a multiple of ``world_size``."""
        return self.shard_numel(world_size) * world_size

    def shard_range(self, rank: int, world_size: int) -> range:
        """The flat-buffer elements ``rank`` owns (half-open; may reach into padding)."""
        check_rank(rank, world_size)
        n = self.shard_numel(world_size)
        return range(rank * n, (rank + 1) * n)

    # - metadata

    def range_metadata(self, flat_range: range) -> ShardMetadata:
        """Which parameters, and which of their elements, lie inside ``flat_range``."""
        a, b = flat_range.start, flat_range.stop
        if flat_range.step != 1 or not 0 <= a <= b:
            raise LayoutError(
                f"flat_range must have step 1 and 0 <= start <= stop, got {flat_range!r}"
            )
        infos: list[ParamShardInfo] = []
        # Only the last parameter starting at or before `a` can contain `a`.
        i = max(bisect.bisect_right(self.offsets, a) - 1, 0)
        while i < len(self.params) and self.offsets[i] < b:
            spec, off = self.params[i], self.offsets[i]
            lo, hi = max(a, off), min(b, off + spec.numel)
            if lo < hi:
                infos.append(
                    ParamShardInfo(
                        index=i,
                        name=spec.name,
                        shape=spec.shape,
                        numel=spec.numel,
                        start=lo - off,
                        end=hi - off - 1,
                        offset_in_range=lo - a,
                    )
                )
            i += 1
        return ShardMetadata(flat_range, tuple(infos))

    def shard_metadata(self, rank: int, world_size: int) -> ShardMetadata:
        """Which parameters, and which of their elements, ``rank``'s shard holds."""
        return self.range_metadata(self.shard_range(rank, world_size))

    # - data

    def flatten(
        self,
        tensors: Sequence[torch.Tensor | None],
        out: torch.Tensor | None = None,
        *,
        world_size: int | None = None,
    ) -> torch.Tensor:
        """Lay ``tensors`` (one per parameter, in order) out as one flat buffer.

        The result has ``total_numel`` elements, or ``padded_numel(world_size)``
        when ``world_size`` is given (the input of a reduce-scatter). Padding is
        zero, and so is the place of a ``None`` entry (a gradient that was not
        computed). ``out``, when given, must be a contiguous 1-D tensor of exactly
        that many elements; it is filled (cast to its dtype) and returned.
        Without ``out``, the buffer takes the dtype and device of the first
        tensor given (the layout's when every entry is ``None``), and autograd
        records the copy. See [Note: One copy per call].
        """
        items = self._check_count(tensors, "flatten")
        numel = self.total_numel if world_size is None else self.padded_numel(world_size)
        ref = next((t for t in items if t is not None), None)
        if out is not None:
            self._check_out(out, numel, "flatten")
        tail = numel - self.total_numel
        missing = [spec.numel for spec, t in zip(self.params, items, strict=True) if t is None]
        zeros = torch.zeros(
            max([tail, self._max_gap, *missing]),
            dtype=(self.dtype if ref is None else ref.dtype) if out is None else out.dtype,
            device=(self.device if ref is None else ref.device) if out is None else out.device,
        )
        pieces: list[torch.Tensor] = []
        for i, (spec, t) in enumerate(zip(self.params, items, strict=True)):
            if i:
                pad = self._split_sizes[2 * i - 1]
                if pad:
                    pieces.append(zeros[:pad])
            if t is None:
                pieces.append(zeros[: spec.numel])
            else:
                self._check_shape(spec, t, "flatten")
                pieces.append(t.reshape(-1))
        if tail:
            pieces.append(zeros[:tail])
        return torch.cat(pieces) if out is None else torch.cat(pieces, out=out)

    def views(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Views of ``flat`` in each parameter's shape, in order; no copy.

        ``flat`` is a 1-D buffer of at least ``total_numel`` elements in this
        layout (the unpadded buffer, or an all-gathered padded one), of any
        dtype and device. Writing through a view writes ``flat``, and autograd
        flows from the views back into ``flat``.
        """
        if flat.dim() != 1 or flat.numel() < self.total_numel:
            raise LayoutError(
                f"views needs a 1-D buffer of at least total_numel={self.total_numel} "
                f"elements, got shape {fmt_shape(flat.shape)}"
            )
        sizes = [*self._split_sizes, flat.numel() - self.total_numel]
        pieces = torch.split_with_sizes(flat, sizes)
        return tuple(pieces[2 * i].view(spec.shape) for i, spec in enumerate(self.params))

    def shard(
        self,
        flat_or_tensors: torch.Tensor | Sequence[torch.Tensor],
        rank: int,
        world_size: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``rank``'s shard: its ``shard_numel(world_size)`` elements, padding zeroed.

        ``flat_or_tensors`` is a flat buffer in this layout (at least
        ``total_numel`` elements) or the parameters themselves, one per spec, in
        order; from parameters, only the elements the rank owns are read and no
        full flat buffer is built. Padding in the shard is zero whatever the input
        holds there. The result never aliases the input and never requires
        grad: it is ``out`` (a contiguous 1-D tensor of
        ``shard_numel(world_size)`` elements, written in its dtype), or a new
        tensor of the input's dtype and device.
        """
        meta = self.shard_metadata(rank, world_size)
        n = self.shard_numel(world_size)
        source: Callable[[ParamShardInfo], torch.Tensor]
        if isinstance(flat_or_tensors, torch.Tensor):
            flat = flat_or_tensors
            if flat.dim() != 1 or flat.numel() < self.total_numel:
                raise LayoutError(
                    f"shard needs a 1-D flat buffer of at least total_numel={self.total_numel} "
                    f"elements, or one tensor per parameter; got shape {fmt_shape(flat.shape)}"
                )
            ref = flat

            def source(info: ParamShardInfo) -> torch.Tensor:
                return flat.narrow(0, self.offsets[info.index] + info.start, info.numel_in_range)

        else:
            tensors = self._check_count(flat_or_tensors, "shard")
            for spec, t in zip(self.params, tensors, strict=True):
                self._check_shape(spec, t, "shard")
            ref = tensors[0]

            def source(info: ParamShardInfo) -> torch.Tensor:
                part = tensors[info.index].reshape(-1)
                return part.narrow(0, info.start, info.numel_in_range)

        if out is None:
            out = torch.empty(n, dtype=ref.dtype, device=ref.device)
        else:
            self._check_out(out, n, "shard")
        zeros = torch.zeros(n - meta.numel_in_params, dtype=out.dtype, device=out.device)
        pieces: list[torch.Tensor] = []
        cursor = 0
        for info in meta.params:
            if info.offset_in_range > cursor:
                pieces.append(zeros[: info.offset_in_range - cursor])
            pieces.append(source(info))
            cursor = info.offset_in_range + info.numel_in_range
        if n > cursor:
            pieces.append(zeros[: n - cursor])
        if not pieces:  # a unit of empty parameters: nothing to write
            return out
        with torch.no_grad():  # See [Note: One copy per call]
            return torch.cat(pieces, out=out)

    def shard_views(
        self, shard: torch.Tensor, rank: int, world_size: int
    ) -> tuple[torch.Tensor, ...]:
        """1-D views of ``shard`` holding each parameter's elements on ``rank``.

        One view per entry of ``shard_metadata(rank, world_size).params``, in
        that order; padding is left out. ``shard`` is the rank's 1-D shard of
        ``shard_numel(world_size)`` elements (any dtype and device).
        """
        meta = self.shard_metadata(rank, world_size)
        n = self.shard_numel(world_size)
        if shard.dim() != 1 or shard.numel() != n:
            raise LayoutError(
                f"shard_views needs rank {rank}'s 1-D shard of shard_numel={n} elements "
                f"(world_size {world_size}), got shape {fmt_shape(shard.shape)}"
            )
        return tuple(shard.narrow(0, p.offset_in_range, p.numel_in_range) for p in meta.params)

    # - helpers

    def _check_count(self, tensors: Iterable[_T], what: str) -> list[_T]:
        items = list(tensors)
        if len(items) != len(self.params):
            raise LayoutError(
                f"{what} got {len(items)} tensors for a layout of {len(self.params)} "
                "parameters: pass one per parameter, in layout order"
            )
        return items

    def _check_shape(self, spec: ParamSpec, tensor: torch.Tensor, what: str) -> None:
        if tensor.shape != spec.shape:
            raise LayoutError(
                f"{what} got a tensor of shape {fmt_shape(tensor.shape)} for parameter "
                f"{spec.name!r}, whose shape is {fmt_shape(spec.shape)}"
            )

    def _check_out(self, out: torch.Tensor, numel: int, what: str) -> None:
        if out.dim() != 1 or out.numel() != numel or not out.is_contiguous():
            raise LayoutError(
                f"{what} needs out to be a contiguous 1-D tensor of {numel} elements, got "
                f"shape {fmt_shape(out.shape)}"
                + ("" if out.is_contiguous() else " (not contiguous)")
            )
