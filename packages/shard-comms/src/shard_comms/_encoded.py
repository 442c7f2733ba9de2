"""Collectives that send encoded data: a comm codec's all-gather, reduce-scatter and all-reduce.

A :class:`~shard_core.protocols.CommCodec` (registered by a plugin, such as
shard-comm-quant's ``"int8"``) turns rows of values into rows of bytes and
back; the functions here run the collectives around it, counted, recorded
by the flight recorder and named in profiles like every other collective
of shard. The runtime uses them for units that ``set_comm_codec`` selects.

[Note: Encoded collectives]
- all-gather: each rank encodes its shard, the encoded rows are gathered,
  and every rank decodes every row, its own included, so all ranks compute
  with bitwise the same full parameters (the values a one-process run that
  applies the same encoding to each shard would use).
- reduce-scatter: each rank encodes its gradient as ``group size`` rows, one
  per destination rank, and an all-to-all sends row ``j`` to rank ``j``.
  Each rank decodes what it received into float32 and sums the rows in
  rank order (``torch.sum`` over dim 0); its own row never crosses the wire
  and is summed exact. The sum is divided by ``pre_divide * post_divide``
  in float32 and cast into the output's dtype. Over gloo an all-to-all of
  the same buffer costs about 0.4x an all-reduce (``bench_comms``-style
  measurement in shard-comm-quant's README), so nothing is lost against
  shard's all-reduce-based reduce-scatter of fp32.
- all-reduce (the replicas of a hybrid mesh, or a unit that is not
  sharded): the same encoded reduce-scatter over the tensor cut into
  ``group size`` chunks, then an encoded all-gather of the summed chunks.
  Every rank decodes every chunk, its own included, so replicas end
  bitwise equal; the wire carries about the bytes of two encoded copies of
  the tensor, as a ring all-reduce carries two copies in its own dtype.
- error feedback (:class:`ErrorFeedback`): where the caller passes one,
  each encode adds what the previous one lost on that path (the residual)
  and keeps what this one loses, so over steps nothing is lost but the
  last residual. The reduce-scatter keeps a residual of the rows it sends
  (``group size - 1`` of them: on 2 ranks the size of this rank's gradient
  shard, on many nearly the full gradient), the all-reduce one of the
  chunks it sends and one of a chunk. They are float32 and live as long as
  the caller keeps the object; ``shard plan --comm-quant`` counts them.

A world of one sends nothing, so nothing is encoded: the all-gather copies,
the reductions only divide. The encoded rows and the float32 rows decoded
from them are leased from the staging-buffer cache (``_buffers.py``) and
given back when the collective is finished.

[Note: Decoding on the waiting stream]
An asynchronous encoded collective decodes in its handle's ``wait()``, on
the stream that waits (the compute stream), from buffers allocated where it
was issued (the all-gather or reduce-scatter stream). On an accelerator the
received rows are therefore marked as used by the waiting stream
(``record_stream``) before they are let go, so the caching allocator does
not hand their memory to the issuing stream while the decode is queued. The
CPU has no streams; this path has not run on a GPU yet.

[Note: What an encoded collective counts]
Each counts once, as the collective it implements (``all_gather``,
``reduce_scatter``, ``all_reduce``), with the bytes of its encoded buffer in
the unsharded convention of [Note: What a counted byte is]: the gathered
rows, the full set of rows sent, and for the all-reduce the encoded rows of
the whole tensor. Ratios against the float counts are then ratios of bytes
on the wire: a ring all-reduce moves twice its tensor, and the encoded one
moves twice its encoded rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from shard_comms._buffers import buffer_cache
from shard_comms._collectives import _DONE, CommHandle, _gather, _issued, _issuing, _size_rank
from shard_core import get_registry
from shard_core.errors import CommError
from shard_core.protocols import CommCodec

__all__ = [
    "CodecSpec",
    "ENCODABLE_DTYPES",
    "ErrorFeedback",
    "encoded_all_gather",
    "encoded_all_reduce",
    "encoded_reduce_scatter",
    "resolve_comm_codec",
]

CodecSpec = str | tuple[str, Mapping[str, Any]] | CommCodec
"""How a user names a codec: a registered name (``"int8"``), a name with options
(``("int8", {"block_size": 128})``), or a :class:`~shard_core.protocols.CommCodec`."""

ENCODABLE_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
"""Dtypes the encoded collectives take; others (bytes of mixed-dtype units, float8) go plain."""


class ErrorFeedback:
    """What one reduction path's encodings lost, to be sent with the next (error feedback).

    One per unit and gradient bucket, kept by the caller between steps. The
    residuals are float32, created as zeros the first time a path needs
    one, and reset to zeros when the shape they are asked for changes (a
    parameter frozen or unfrozen). See [Note: Encoded collectives].
    """

    __slots__ = ("_residuals",)

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}

    def residual(self, path: str, rows: int, numel: int, device: torch.device) -> torch.Tensor:
        """The ``(rows, numel)`` float32 residual of ``path`` (zeros the first time)."""
        residual = self._residuals.get(path)
        if residual is None or residual.shape != (rows, numel) or residual.device != device:
            residual = torch.zeros(rows, numel, dtype=torch.float32, device=device)
            self._residuals[path] = residual
        return residual

    @property
    def nbytes(self) -> int:
        """Bytes the residuals hold."""
        return sum(r.numel() * r.element_size() for r in self._residuals.values())

    def clear(self) -> None:
        """Forget every residual (the next encodings start from zero)."""
        self._residuals.clear()

    def __repr__(self) -> str:
        return f"ErrorFeedback(paths={sorted(self._residuals)}, nbytes={self.nbytes})"


class _Leases:
    """Buffers leased from the staging cache for one collective, given back together."""

    __slots__ = ("_bases",)

    def __init__(self) -> None:
        self._bases: list[torch.Tensor] = []

    def take(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A ``(rows, cols)`` buffer of ``dtype`` (contents undefined)."""
        base = buffer_cache().acquire(rows * cols, dtype, device)
        self._bases.append(base)
        return base[: rows * cols].view(rows, cols)

    def release(self) -> None:
        cache = buffer_cache()
        for base in self._bases:
            cache.release(base)
        self._bases.clear()


def resolve_comm_codec(codec: CodecSpec | None) -> CommCodec | None:
    """The codec a user asked for: ``None`` (none), a registered name, a name with options, or one.

    Names are looked up through the ``shard_comm_codecs`` plugin hook; an
    unknown name raises :class:`~shard_core.errors.UnknownPluginNameError`
    listing the registered ones.
    """
    if codec is None:
        return None
    if isinstance(codec, str):
        return get_registry().comm_codec(codec)
    if (
        isinstance(codec, tuple)
        and len(codec) == 2
        and isinstance(codec[0], str)
        and isinstance(codec[1], Mapping)
    ):
        return get_registry().comm_codec(codec[0], **codec[1])
    if isinstance(codec, CommCodec):
        return codec
    raise TypeError(
        f"comm codec {codec!r} ({type(codec).__name__}) is neither a registered codec name, "
        "a (name, options) pair nor a CommCodec; pass a name such as 'int8' (pip install "
        "./plugins/shard-comm-quant), ('int8', {'block_size': 128}), or an object with "
        "encoded_nbytes(), encode() and decode()"
    )


def _check_dtype(tensor: torch.Tensor, caller: str) -> None:
    if tensor.dtype not in ENCODABLE_DTYPES:
        raise CommError(
            f"{caller}: {tensor.dtype} cannot be encoded (a codec takes "
            f"{', '.join(sorted(str(d) for d in ENCODABLE_DTYPES))}); run the plain collective"
        )


def encoded_all_gather(
    codec: CommCodec,
    output: torch.Tensor,
    shard: torch.Tensor,
    group: ProcessGroup | None = None,
    *,
    async_op: bool = False,
    label: str | None = None,
    phase: str | None = None,
) -> CommHandle:
    """Gather every rank's encoded ``shard`` and decode all of them into ``output``, in rank order.

    ``output`` is contiguous with ``group size * shard.numel()`` elements of a
    floating dtype; after the handle's ``wait()`` it holds every rank's
    decoded shard, this rank's included. See [Note: Encoded collectives].
    """
    size, _ = _size_rank(group, "encoded_all_gather")
    numel = shard.numel()
    if output.numel() != numel * size or not output.is_contiguous():
        raise CommError(
            f"encoded_all_gather: output has {output.numel()} elements (contiguous: "
            f"{output.is_contiguous()}) but {size} ranks each contributing {numel} need a "
            f"contiguous {numel * size}; size the output as world size * shard elements"
        )
    _check_dtype(output, "encoded_all_gather")
    if size == 1:
        output.view(shard.shape).copy_(shard)
        return _DONE
    row = codec.encoded_nbytes(numel)
    leases = _Leases()
    send = leases.take(1, row, torch.uint8, output.device)
    codec.encode(shard.reshape(1, numel), send)
    gathered = leases.take(size, row, torch.uint8, output.device)
    with _issuing("all_gather", gathered.view(-1), size, group, label, phase) as entry:
        work = _gather(gathered.view(-1), send.view(-1), size, group, async_op)

    def finish() -> None:
        codec.decode(gathered, output.view(size, numel))
        _used_on_current_stream(gathered)
        leases.release()

    return _issued(entry, work, finish, async_op)


def encoded_reduce_scatter(
    codec: CommCodec,
    output: torch.Tensor,
    grad: torch.Tensor,
    group: ProcessGroup | None = None,
    *,
    feedback: ErrorFeedback | None = None,
    pre_divide: float = 1.0,
    post_divide: float = 1.0,
    async_op: bool = False,
    label: str | None = None,
    phase: str | None = None,
) -> CommHandle:
    """Sum the ranks' flat ``grad`` in float32 from encoded rows; this rank's slice into ``output``.

    ``grad`` has ``group size * output.numel()`` elements; rank ``r`` gets the
    sum of elements ``[r * n, (r + 1) * n)`` over ranks, divided by
    ``pre_divide * post_divide``. ``feedback`` keeps the residual of this
    path between calls. ``grad`` is only read, and (this rank's row is summed
    from it when the handle is waited) must stay unchanged until then, as a
    plain reduce-scatter's input must. See [Note: Encoded collectives].
    """
    size, rank = _size_rank(group, "encoded_reduce_scatter")
    n = output.numel()
    if grad.numel() != n * size or not output.is_contiguous():
        raise CommError(
            f"encoded_reduce_scatter: grad has {grad.numel()} elements and the output "
            f"{n} (contiguous: {output.is_contiguous()}) on {size} ranks, which needs "
            f"{n * size} and a contiguous output; pad the flat gradient to a multiple of the "
            "world size and size the output as its 1/world-size slice"
        )
    _check_dtype(grad, "encoded_reduce_scatter")
    divide = pre_divide * post_divide
    rows = grad.reshape(size, n)
    if size == 1:
        output.view(-1).copy_(rows[0].to(torch.float32) / divide)
        return _DONE
    leases = _Leases()
    send = _encode_rows(codec, rows, rank, feedback, "scatter", leases)
    received = leases.take(size, send.shape[1], torch.uint8, send.device)
    own = rows[rank]  # read in finish; see the docstring
    with _issuing("reduce_scatter", send.view(-1), size, group, label, phase) as entry:
        work = dist.all_to_all_single(received, send, group=group, async_op=async_op)

    def finish() -> None:
        flat_out = output.view(-1)
        target = flat_out if flat_out.dtype == torch.float32 else None
        total = _sum_received(codec, received, own, rank, leases, out=target)
        if divide != 1.0:
            total.div_(divide)
        if target is None:
            flat_out.copy_(total)
        _used_on_current_stream(received, own)
        leases.release()

    return _issued(entry, work, finish, async_op)


def _used_on_current_stream(*tensors: torch.Tensor) -> None:
    """See [Note: Decoding on the waiting stream]; nothing on the CPU."""
    for tensor in tensors:
        if tensor.device.type != "cpu":
            tensor.record_stream(torch.accelerator.current_stream(tensor.device))


def _others(rows: torch.Tensor, rank: int) -> list[torch.Tensor]:
    """The row blocks of ``rows`` before and after row ``rank`` (empty ones left out)."""
    return [block for block in (rows[:rank], rows[rank + 1 :]) if block.shape[0]]


def _encode_rows(
    codec: CommCodec,
    rows: torch.Tensor,
    rank: int,
    feedback: ErrorFeedback | None,
    path: str,
    leases: _Leases,
) -> torch.Tensor:
    """``rows`` (one per destination rank) encoded, with ``path``'s error feedback if any.

    This rank's own row is never sent, so it is not encoded (its bytes in the
    send buffer are whatever they were) and has no residual: the residual
    holds the other ``size - 1`` rows, in rank order. See [Note: Encoded
    collectives].
    """
    size, n = rows.shape
    send = leases.take(size, codec.encoded_nbytes(n), torch.uint8, rows.device)
    blocks = _others(rows, rank)
    kept: list[torch.Tensor | None] = [None] * len(blocks)
    if feedback is not None:
        residual = feedback.residual(path, size - 1, n, rows.device)
        kept = [block for block in (residual[:rank], residual[rank:]) if block.shape[0]]
    for values, out, lost in zip(blocks, _others(send, rank), kept, strict=True):
        codec.encode(values, out, lost)
    return send


def _sum_received(
    codec: CommCodec,
    received: torch.Tensor,
    own: torch.Tensor,
    rank: int,
    leases: _Leases,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The float32 sum, in rank order, of the decoded rows, this rank's own row exact.

    Written into ``out`` (float32, ``own``'s size) when given.
    """
    decoded = leases.take(received.shape[0], own.numel(), torch.float32, own.device)
    for encoded, values in zip(_others(received, rank), _others(decoded, rank), strict=True):
        codec.decode(encoded, values)
    decoded[rank].copy_(own)
    if out is None:
        return torch.sum(decoded, dim=0)
    return torch.sum(decoded, dim=0, out=out)


def encoded_all_reduce(
    codec: CommCodec,
    tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    *,
    feedback: ErrorFeedback | None = None,
    path: str = "all_reduce",
    pre_divide: float = 1.0,
    post_divide: float = 1.0,
    label: str | None = None,
    phase: str | None = None,
) -> CommHandle:
    """Sum ``tensor`` over the ranks from encoded chunks, in place, equal on every rank.

    Divides the float32 sum by ``pre_divide * post_divide``. ``feedback``
    keeps this path's two residuals under ``path`` (one caller may run
    several all-reduces). Synchronous; the handle is done. See
    [Note: Encoded collectives].
    """
    size, rank = _size_rank(group, "encoded_all_reduce")
    _check_dtype(tensor, "encoded_all_reduce")
    if not tensor.is_contiguous():
        raise CommError(
            "encoded_all_reduce: tensor must be contiguous (it is written in place); pass a "
            "contiguous tensor, e.g. a view of a flat buffer"
        )
    divide = pre_divide * post_divide
    flat = tensor.view(-1)
    if size == 1:
        if divide != 1.0:
            flat.div_(divide)
        return _DONE
    numel = flat.numel()
    chunk = -(-numel // size)
    leases = _Leases()
    rows = leases.take(size, chunk, torch.float32, flat.device)
    rows.view(-1)[numel:] = 0.0
    rows.view(-1)[:numel].copy_(flat)
    row = codec.encoded_nbytes(chunk)
    gathered = leases.take(size, row, torch.uint8, flat.device)
    with _issuing("all_reduce", gathered.view(-1), size, group, label, phase) as entry:
        send = _encode_rows(codec, rows, rank, feedback, path, leases)
        received = leases.take(size, row, torch.uint8, flat.device)
        dist.all_to_all_single(received, send, group=group)
        partial = _sum_received(codec, received, rows[rank], rank, leases).view(1, chunk)
        own = leases.take(1, row, torch.uint8, flat.device)
        residual = (
            None if feedback is None else feedback.residual(f"{path}_sum", 1, chunk, flat.device)
        )
        codec.encode(partial, own, residual)
        _gather(gathered.view(-1), own.view(-1), size, group, False)
    summed = leases.take(size, chunk, torch.float32, flat.device)
    codec.decode(gathered, summed)
    if divide != 1.0:
        summed.div_(divide)
    flat.copy_(summed.view(-1)[:numel])
    leases.release()
    return _issued(entry, None, None, False)
