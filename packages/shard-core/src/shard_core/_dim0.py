"""Per-parameter dim-0 sharding: which rows each rank holds, and one all-gather per unit.

The composable front end (``fully_shard``) shards every parameter on dim 0
with ``torch.chunk`` semantics, so that a parameter's shard is a plain slice
of rows and checkpoints line up with PyTorch's. A unit still communicates
once: :class:`PackedDim0Layout` packs every parameter's padded shard into one
flat per-rank buffer for a single all-gather, and unpacks the gathered buffer
into full parameters with views and one copy for the whole unit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from shard_core._layout import ParamSpec
from shard_core._validate import (
    check_dim0_shape,
    check_not_empty,
    check_rank,
    check_unique_names,
    check_unit_tensors,
    check_world_size,
    fmt_shape,
)
from shard_core.errors import LayoutError

__all__ = [
    "PackedDim0Layout",
    "chunk_dim0",
    "contiguous_stride",
    "dim0_chunk_range",
    "dim0_chunk_sizes",
    "pad_dim0",
    "padded_dim0_size",
    "unpad_dim0",
]

# [Note: Chunk semantics]
# A parameter with d rows over N ranks is cut into chunks of c = ceil(d / N) rows:
# rank r holds rows [r * c, min((r + 1) * c, d)), which is torch.chunk(param, N)[r],
# or an empty (0, *rest) slice where torch.chunk returns fewer than N chunks
# (d=5, N=4: 2, 2, 1, 0 rows; d=9, N=4: 3, 3, 3, 0; d=3, N=4: 1, 1, 1, 0).
# Every rank contributes c rows to an all-gather (its rows, then zero rows).
# Only the last non-empty chunk can be short and every chunk after it is empty, so
# the parameter's rows are exactly the first d rows of the gathered (N * c, *rest)
# buffer: unpadding is a view, never a copy, even when shards are uneven.
#
# [Note: Packed all-gather]
# One rank's all-gather input holds, for each parameter j in order, its padded
# shard (c_j rows of row_numel_j elements, shard_numel_j in all) at offsets[j]:
#
#   | p0 rows, zero rows | p1 rows, zero rows | ... |    per_rank_numel
#
# The gathered output is the N per-rank buffers back to back: a
# (N, per_rank_numel) matrix whose columns [offsets[j], offsets[j] + shard_numel_j)
# hold, rank after rank, parameter j's padded full tensor. Unpacking copies those
# column blocks into one (N * c_j, *rest_j) buffer per parameter, all in one
# torch.split_with_sizes_copy, and returns the first d_j rows of each as a view.


def _check_dim0(dim0: int) -> None:
    if not isinstance(dim0, int) or isinstance(dim0, bool) or dim0 < 0:
        raise LayoutError(f"dim0 must be an integer >= 0 (a number of rows), got {dim0!r}")


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Strides of a contiguous tensor of ``shape`` (what a full parameter's DTensor declares)."""
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def padded_dim0_size(dim0: int, world_size: int) -> int:
    """Rows each rank contributes to the all-gather: ``ceil(dim0 / world_size)``.

    This is the size of chunk 0, the largest chunk.
    """
    _check_dim0(dim0)
    check_world_size(world_size)
    return -(-dim0 // world_size)


def dim0_chunk_range(dim0: int, rank: int, world_size: int) -> range:
    """The rows ``rank`` holds of a dim-0 size ``dim0`` (empty past the last chunk)."""
    check_rank(rank, world_size)
    c = padded_dim0_size(dim0, world_size)
    return range(min(rank * c, dim0), min((rank + 1) * c, dim0))


def dim0_chunk_sizes(dim0: int, world_size: int) -> tuple[int, ...]:
    """Rows per rank, ``world_size`` entries: ``dim0_chunk_sizes(5, 4) == (2, 2, 1, 0)``."""
    c = padded_dim0_size(dim0, world_size)
    return tuple(max(0, min(c, dim0 - r * c)) for r in range(world_size))


def chunk_dim0(
    tensor: torch.Tensor, rank: int, world_size: int, *, name: str = "tensor"
) -> torch.Tensor:
    """``rank``'s chunk of ``tensor`` on dim 0: a view, ``(0, *rest)`` past the last chunk.

    Equal to ``torch.chunk(tensor, world_size)[rank]`` where that exists. ``name``
    is the parameter's qualified name, for the error a 0-d tensor raises.
    See [Note: Chunk semantics].
    """
    check_dim0_shape(name, tensor.shape)
    rows = dim0_chunk_range(tensor.shape[0], rank, world_size)
    return tensor.narrow(0, rows.start, len(rows))


def pad_dim0(
    shard: torch.Tensor, padded_size: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``shard`` followed by zero rows up to ``padded_size`` rows.

    Without ``out``, a shard that already has ``padded_size`` rows is returned
    itself (no copy); otherwise a new tensor of its dtype and device. With
    ``out`` (contiguous, shape ``(padded_size, *shard.shape[1:])``), the rows
    are written there, cast to its dtype, and ``out`` is returned. A copy
    never records autograd.
    """
    if shard.dim() == 0:
        raise LayoutError("pad_dim0 needs a shard with at least one dimension, got a 0-d tensor")
    _check_dim0(padded_size)
    rows, rest = shard.shape[0], tuple(shard.shape[1:])
    if rows > padded_size:
        raise LayoutError(
            f"cannot pad a shard of {rows} rows to {padded_size} rows: padded_size must be "
            "at least the shard's dim-0 size (use padded_dim0_size(dim0, world_size))"
        )
    shape = (padded_size, *rest)
    if out is None:
        if rows == padded_size:
            return shard
        out = shard.new_empty(shape)
    elif tuple(out.shape) != shape or not out.is_contiguous():
        raise LayoutError(
            f"pad_dim0 needs out to be contiguous with shape {fmt_shape(shape)}, "
            f"got shape {fmt_shape(out.shape)}"
            + ("" if out.is_contiguous() else " (not contiguous)")
        )
    zeros = torch.zeros((padded_size - rows, *rest), dtype=out.dtype, device=out.device)
    with torch.no_grad():  # data movement: sharded parameters may require grad
        return torch.cat([shard, zeros], out=out)


def unpad_dim0(gathered: torch.Tensor, dim0: int, world_size: int) -> torch.Tensor:
    """The full tensor from an all-gather of padded chunks: a view of the first ``dim0`` rows.

    ``gathered`` has shape ``(world_size * padded_dim0_size(dim0, world_size), *rest)``.
    See [Note: Chunk semantics] for why this never copies.
    """
    expected = world_size * padded_dim0_size(dim0, world_size)
    if gathered.dim() == 0 or gathered.shape[0] != expected:
        raise LayoutError(
            f"unpad_dim0 needs {expected} gathered rows (world_size {world_size} x "
            f"padded_dim0_size {expected // world_size}) for dim0={dim0}, got shape "
            f"{fmt_shape(gathered.shape)}"
        )
    return gathered.narrow(0, 0, dim0)


@dataclass(frozen=True, repr=False)
class PackedDim0Layout:
    """How a unit's dim-0 shards share one flat all-gather buffer per rank.

    See [Note: Packed all-gather]. Shapes only: the same layout serves any
    dtype and device, and is built for one world size.

    Attributes:
        params: The parameters with their full shapes (at least 1-D), in packing order.
        world_size: The number of ranks the parameters are sharded over.
        padded_dim0_sizes: Rows each rank contributes, per parameter (derived).
        row_numels: Elements per row, per parameter (derived).
        shard_numels: Elements of each parameter's padded shard (derived).
        offsets: Start of each parameter's padded shard in a rank's buffer (derived).
        per_rank_numel: Elements of one rank's packed buffer (derived).
    """

    params: tuple[ParamSpec, ...]
    world_size: int
    padded_dim0_sizes: tuple[int, ...] = field(init=False, compare=False)
    row_numels: tuple[int, ...] = field(init=False, compare=False)
    shard_numels: tuple[int, ...] = field(init=False, compare=False)
    offsets: tuple[int, ...] = field(init=False, compare=False)
    per_rank_numel: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        params = tuple(self.params)
        if not all(isinstance(p, ParamSpec) for p in params):
            raise LayoutError(
                "PackedDim0Layout(params=...) takes ParamSpec entries: use "
                "PackedDim0Layout.from_specs for (name, shape) pairs"
            )
        object.__setattr__(self, "params", params)
        check_not_empty(len(params))
        check_unique_names(p.name for p in params)
        check_world_size(self.world_size)
        for p in params:
            check_dim0_shape(p.name, p.shape)
        padded = tuple(padded_dim0_size(p.shape[0], self.world_size) for p in params)
        row_numels = tuple(math.prod(p.shape[1:]) for p in params)
        shard_numels = tuple(c * r for c, r in zip(padded, row_numels, strict=True))
        offsets = [0]
        for n in shard_numels[:-1]:
            offsets.append(offsets[-1] + n)
        object.__setattr__(self, "padded_dim0_sizes", padded)
        object.__setattr__(self, "row_numels", row_numels)
        object.__setattr__(self, "shard_numels", shard_numels)
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "per_rank_numel", sum(shard_numels))

    @classmethod
    def from_tensors(
        cls,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        world_size: int,
    ) -> PackedDim0Layout:
        """The layout of ``named_tensors`` (full parameters) over ``world_size`` ranks.

        The tensors must be non-empty in number, at least 1-D, floating point,
        contiguous, of one dtype and on one device; each must appear once.
        """
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        check_unit_tensors(items)
        return cls(tuple(ParamSpec.from_tensor(n, t) for n, t in items), world_size)

    @classmethod
    def from_specs(
        cls, specs: Iterable[ParamSpec | tuple[str, Sequence[int]]], world_size: int
    ) -> PackedDim0Layout:
        """The layout of parameters given as ``ParamSpec`` or ``(name, full shape)`` pairs."""
        params = tuple(
            s if isinstance(s, ParamSpec) else ParamSpec(s[0], tuple(s[1])) for s in specs
        )
        return cls(params, world_size)

    def __repr__(self) -> str:
        return (
            f"PackedDim0Layout({len(self.params)} params, world_size={self.world_size}, "
            f"per_rank_numel={self.per_rank_numel})"
        )

    @property
    def gathered_numel(self) -> int:
        """Elements of the all-gather output: ``world_size * per_rank_numel``."""
        return self.world_size * self.per_rank_numel

    def shard_shape(self, index: int, rank: int) -> tuple[int, ...]:
        """Shape of parameter ``index``'s (unpadded) shard on ``rank``."""
        spec = self.params[index]
        rows = dim0_chunk_range(spec.shape[0], rank, self.world_size)
        return (len(rows), *spec.shape[1:])

    def pack(
        self, shards: Sequence[torch.Tensor], rank: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``rank``'s all-gather input: each parameter's shard, zero-padded, back to back.

        ``shards`` are ``rank``'s unpadded chunks, one per parameter in order,
        of shape :meth:`shard_shape`. One ``torch.cat`` writes them into ``out``
        (a contiguous 1-D tensor of ``per_rank_numel`` elements, cast to its
        dtype), or into a new tensor of the first shard's dtype and device.
        The result never requires grad.
        """
        check_rank(rank, self.world_size)
        items = list(shards)
        if len(items) != len(self.params):
            raise LayoutError(
                f"pack got {len(items)} shards for a layout of {len(self.params)} parameters: "
                "pass one per parameter, in layout order"
            )
        for j, (spec, shard) in enumerate(zip(self.params, items, strict=True)):
            expected = self.shard_shape(j, rank)
            if tuple(shard.shape) != expected:
                raise LayoutError(
                    f"pack got a shard of shape {fmt_shape(shard.shape)} for parameter "
                    f"{spec.name!r} on rank {rank} of {self.world_size}, expected "
                    f"{fmt_shape(expected)} (its dim-0 chunk, unpadded)"
                )
        if out is None:
            out = items[0].new_empty(self.per_rank_numel)
        elif out.dim() != 1 or out.numel() != self.per_rank_numel or not out.is_contiguous():
            raise LayoutError(
                f"pack needs out to be a contiguous 1-D tensor of per_rank_numel="
                f"{self.per_rank_numel} elements, got shape {fmt_shape(out.shape)}"
                + ("" if out.is_contiguous() else " (not contiguous)")
            )
        pads = [n - shard.numel() for n, shard in zip(self.shard_numels, items, strict=True)]
        zeros = torch.zeros(max(pads), dtype=out.dtype, device=out.device)
        pieces: list[torch.Tensor] = []
        for shard, pad in zip(items, pads, strict=True):
            pieces.append(shard.reshape(-1))
            if pad:
                pieces.append(zeros[:pad])
        with torch.no_grad():  # data movement: sharded parameters may require grad
            return torch.cat(pieces, out=out)

    def shard(
        self, tensors: Sequence[torch.Tensor], rank: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``rank``'s packed buffer, cut from the full parameters (see :meth:`pack`)."""
        items = list(tensors)
        if len(items) != len(self.params):
            raise LayoutError(
                f"shard got {len(items)} tensors for a layout of {len(self.params)} "
                "parameters: pass one per parameter, in layout order"
            )
        for spec, t in zip(self.params, items, strict=True):
            if t.shape != spec.shape:
                raise LayoutError(
                    f"shard got a tensor of shape {fmt_shape(t.shape)} for parameter "
                    f"{spec.name!r}, whose shape is {fmt_shape(spec.shape)}"
                )
        check_rank(rank, self.world_size)
        chunks = [
            chunk_dim0(t, rank, self.world_size, name=spec.name)
            for spec, t in zip(self.params, items, strict=True)
        ]
        return self.pack(chunks, rank, out)

    def shard_views(self, packed: torch.Tensor, rank: int) -> tuple[torch.Tensor, ...]:
        """Each parameter's unpadded shard on ``rank`` as a view of its packed buffer.

        Lets the packed buffer itself be the sharded storage, so that the
        all-gather input needs no copy.
        """
        check_rank(rank, self.world_size)
        if packed.dim() != 1 or packed.numel() != self.per_rank_numel:
            raise LayoutError(
                f"shard_views needs a 1-D packed buffer of per_rank_numel="
                f"{self.per_rank_numel} elements, got shape {fmt_shape(packed.shape)}"
            )
        views = []
        for j, off in enumerate(self.offsets):
            shape = self.shard_shape(j, rank)
            views.append(packed.narrow(0, off, math.prod(shape)).view(shape))
        return tuple(views)

    def unpack(
        self, gathered: torch.Tensor, out: Sequence[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, ...]:
        """The full parameters from the all-gathered packed buffers.

        ``gathered`` is the all-gather output (``world_size`` per-rank buffers
        back to back, contiguous, ``gathered_numel`` elements, any shape). Each
        result is a view of the first ``dim0`` rows of a padded
        ``(world_size * padded_dim0_size, *rest)`` buffer: the matching entry of
        ``out`` (contiguous, any shape, ``world_size * shard_numels[j]`` elements,
        written by one copy for the whole unit), or a new buffer. Without ``out``
        and with one parameter or one rank, the results are views of
        ``gathered`` itself (no copy). See [Note: Packed all-gather].
        """
        ws = self.world_size
        if gathered.numel() != self.gathered_numel or not gathered.is_contiguous():
            raise LayoutError(
                f"unpack needs a contiguous all-gather output of gathered_numel="
                f"{self.gathered_numel} elements (world_size {ws} x per_rank_numel "
                f"{self.per_rank_numel}), got shape {fmt_shape(gathered.shape)}"
                + ("" if gathered.is_contiguous() else " (not contiguous)")
            )
        flat = gathered.view(-1)
        if out is None and (ws == 1 or len(self.params) == 1):
            # The column blocks of [Note: Packed all-gather] are contiguous here.
            padded = [
                flat.narrow(0, ws * off, ws * n)
                for off, n in zip(self.offsets, self.shard_numels, strict=True)
            ]
            return self._unpad_all(padded)
        if out is None:
            buffers = [gathered.new_empty(ws * n) for n in self.shard_numels]
        else:
            buffers = list(out)
            if len(buffers) != len(self.params):
                raise LayoutError(
                    f"unpack got {len(buffers)} out buffers for a layout of "
                    f"{len(self.params)} parameters: pass one per parameter, in layout order"
                )
            for spec, n, buf in zip(self.params, self.shard_numels, buffers, strict=True):
                if buf.numel() != ws * n or not buf.is_contiguous():
                    raise LayoutError(
                        f"unpack needs the out buffer of parameter {spec.name!r} to be "
                        f"contiguous with {ws * n} elements (world_size {ws} x padded shard "
                        f"{n}), got shape {fmt_shape(buf.shape)}"
                        + ("" if buf.is_contiguous() else " (not contiguous)")
                    )
        with torch.no_grad():
            torch.split_with_sizes_copy(
                flat.view(ws, self.per_rank_numel),
                list(self.shard_numels),
                dim=1,
                out=[b.view(ws, n) for b, n in zip(buffers, self.shard_numels, strict=True)],
            )
        return self._unpad_all(buffers)

    def _unpad_all(self, padded: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        ws = self.world_size
        return tuple(
            buf.view(ws * c, *spec.shape[1:]).narrow(0, 0, spec.shape[0])
            for spec, c, buf in zip(self.params, self.padded_dim0_sizes, padded, strict=True)
        )
