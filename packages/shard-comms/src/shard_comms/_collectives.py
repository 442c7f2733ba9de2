"""The collectives the runtime issues on every step, over flat buffers.

Each function is a thin layer over one ``torch.distributed`` call: it checks
sizes, stages through a cached buffer only where a dtype cast or a copy-in of
several tensors needs one, applies the divide factors, counts the call, and
opens a profiler range. Nothing here re-implements a collective.

[Note: Reduce-scatter on gloo]
Measured with ``tools/bench/bench_comms.py`` (gloo, 2 ranks, 1-64 MiB),
``reduce_scatter_single`` is slower than an ``all_reduce`` of the same
buffer: gloo has no native reduce-scatter and emulates it. So on CPU
tensors (gloo) a reduce-scatter runs as an in-place all-reduce of the full
buffer followed by a copy of the rank's slice; on every other device (NCCL)
it is ``reduce_scatter_single``. ``algorithm=`` overrides the choice.

[Note: All-gather on gloo]
gloo's ``all_gather_single`` slows down more than linearly above 16 MiB of
output (2 ranks: about 15 ms at 16 MiB, 130-180 ms at 64 MiB, where an
all-reduce of 64 MiB takes 55 ms). So on CPU tensors an all-gather whose
output exceeds 16 MiB runs as several ``all_gather`` calls of at most 16 MiB
of output each, every rank's piece landing directly in its row of the
output (no staging); that halves the time at 64 MiB. It still counts as one
all-gather. Other backends gather in one call.

[Note: Divide factors]
Averaging over N ranks divides by N. Dividing only at the end lets a sum in
fp16 overflow; dividing only at the start lets small values underflow. So
the gradient is divided by ``pre`` before the collective and the result by
``post`` after, with ``pre * post == N``. ``pre`` doubles from 1 while it
divides N and is below N / ``pre``, which is PyTorch's split, so fp16
gradients round as they do there (N=2: 2 and 1; N=4: 2 and 2; N=8: 4 and 2;
N=6: 4 and 1.5). Powers of two divide exactly, so in fp32 and bf16 the split
changes no bit of the result unless a value under- or overflows. Both
divisions happen in the reduce dtype; :func:`divide_factors` is the one place
the split is made (the runtime's divide plan uses it too).

[Note: Profiler ranges]
Every collective runs inside a profiler range ``shard::<kind> (<label>)``, but
only while a profiler is recording: an open ``record_function`` around a gloo
collective measured 50-100 us per call at 1 MiB (``tools/bench``), 10% of
the collective, for a range nobody reads.

[Note: Gradients are scratch]
``reduce_scatter`` divides and reduces the gradient it is given in place when
it is already in the reduce dtype and contiguous, so its contents are
unspecified afterwards (the runtime frees it anyway). That saves a full-size
copy per unit per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Literal

import torch
import torch.distributed as dist
from torch._C._autograd import _profiler_enabled
from torch.distributed import ProcessGroup
from torch.profiler import record_function

from shard_comms._buffers import buffer_cache
from shard_comms._counters import CollectiveKind, record_collective
from shard_comms._diagnose import collective_failure
from shard_comms._flight import FlightEntry, FlightRecorder, flight_recorder
from shard_core.errors import CollectiveError, CommError, DistributedInitError

__all__ = [
    "CommHandle",
    "ReduceAlgorithm",
    "ReduceOpName",
    "all_gather",
    "all_reduce",
    "broadcast",
    "divide_factors",
    "reduce_scatter",
    "resolve_divide_factors",
]

ReduceOpName = Literal["sum", "avg"]
ReduceAlgorithm = Literal["auto", "reduce_scatter", "all_reduce"]

# Device types whose backend reduce-scatters faster as an all-reduce.
# See [Note: Reduce-scatter on gloo]
_ALL_REDUCE_SCATTER_DEVICES = frozenset({"cpu"})
# Device types whose backend gathers large buffers faster in chunks, and the
# largest gathered chunk. See [Note: All-gather on gloo]
_CHUNKED_GATHER_DEVICES = frozenset({"cpu"})
_GATHER_CHUNK_BYTES = 16 << 20


class CommHandle:
    """An issued collective; :meth:`wait` finishes it.

    Returned by every collective here. A synchronous call returns a handle
    that is already done. ``wait`` blocks until the communication completed,
    then copies results out and divides by the post-divide factor; it is
    idempotent.
    """

    __slots__ = ("_entry", "_finish", "_work")

    def __init__(
        self,
        work: dist.Work | list[dist.Work] | None,
        finish: Callable[[], None] | None,
        entry: FlightEntry | None = None,
    ) -> None:
        self._work = work
        self._finish = finish
        self._entry = entry

    def wait(self) -> None:
        """Block until the result is in its output tensor.

        Raises:
            CollectiveError: the collective failed or timed out; the message
                names what every rank last issued (see ``_diagnose.py``).
        """
        work, self._work = self._work, None
        try:
            if isinstance(work, list):
                for piece in work:
                    piece.wait()
            elif work is not None:
                work.wait()
        except RuntimeError as exc:
            if isinstance(exc, CollectiveError):
                raise
            raise collective_failure(self._entry, exc) from exc
        FlightRecorder.complete(self._entry)
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()

    def is_completed(self) -> bool:
        """Whether :meth:`wait` would return without waiting on communication."""
        work = self._work
        if isinstance(work, list):
            return all(piece.is_completed() for piece in work)
        return work is None or bool(work.is_completed())

    def __repr__(self) -> str:
        state = "done" if self._work is None and self._finish is None else "pending"
        return f"CommHandle({state})"


_DONE = CommHandle(None, None)
_NO_RANGE: AbstractContextManager[object] = nullcontext()


def divide_factors(total: float) -> tuple[float, float]:
    """The ``(pre, post)`` factors that divide by ``total`` around a sum, ``pre * post == total``.

    See [Note: Divide factors]. ``total`` is the number of ranks averaged
    over, or a user's divide factor.
    """
    if not total > 0:
        raise CommError(f"the divide factor must be positive, got {total}")
    pre = 1.0
    while total % pre == 0 and total / pre > pre:
        pre *= 2
    return pre, total / pre


def resolve_divide_factors(
    op: ReduceOpName, world_size: int, pre_divide: float | None, post_divide: float | None
) -> tuple[float, float]:
    """The ``(pre, post)`` factors a reduction over ``world_size`` ranks applies.

    ``"sum"``: the factors given (1 where ``None``), so a caller can scale a
    sum. ``"avg"``: the defaults of :func:`divide_factors` when both
    are ``None``; one given fixes the other (their product is
    ``world_size``); both given must multiply to ``world_size``.
    """
    for name, value in (("pre_divide", pre_divide), ("post_divide", post_divide)):
        if value is not None and not value > 0:
            raise CommError(f"{name} must be a positive number, got {value}")
    if op == "sum":
        return (
            1.0 if pre_divide is None else float(pre_divide),
            1.0 if post_divide is None else float(post_divide),
        )
    if op != "avg":
        raise CommError(f"unknown reduce op {op!r}; use 'sum' or 'avg'")
    if pre_divide is None and post_divide is None:
        return divide_factors(world_size)
    if pre_divide is None:
        assert post_divide is not None
        return world_size / post_divide, float(post_divide)
    if post_divide is None:
        return float(pre_divide), world_size / pre_divide
    if not math.isclose(pre_divide * post_divide, world_size):
        raise CommError(
            f"op='avg' over {world_size} ranks needs pre_divide * post_divide == {world_size}, "
            f"got {pre_divide} * {post_divide}; pass one of them, or use op='sum' to scale freely"
        )
    return float(pre_divide), float(post_divide)


def _size_rank(group: ProcessGroup | None, caller: str) -> tuple[int, int]:
    if group is not None:
        return group.size(), group.rank()
    if not dist.is_initialized():
        raise DistributedInitError(
            f"{caller}: torch.distributed is not initialised and no group was given; "
            "call shard_comms.init_distributed() first"
        )
    return dist.get_world_size(), dist.get_rank()


def _profiler_range(kind: CollectiveKind, label: str | None) -> AbstractContextManager[object]:
    # See [Note: Profiler ranges]
    if not _profiler_enabled():
        return _NO_RANGE
    return record_function(f"shard::{kind}" if label is None else f"shard::{kind} ({label})")


def _check_contiguous(tensor: torch.Tensor, caller: str, what: str) -> None:
    if not tensor.is_contiguous():
        raise CommError(
            f"{caller}: {what} must be contiguous (it is written in place); "
            "pass a contiguous tensor, e.g. a view of a flat buffer"
        )


def _stage(
    tensor: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``tensor`` as a flat, contiguous tensor in ``dtype``.

    A view of ``tensor`` when it already is one; else a copy in a buffer
    leased on ``device``, returned second so the caller releases it when the
    collective is finished.
    """
    if tensor.dtype == dtype and tensor.is_contiguous():
        return tensor.view(-1), None
    base = buffer_cache().acquire(tensor.numel(), dtype, device)
    flat = base[: tensor.numel()]
    flat.view(tensor.shape).copy_(tensor)
    return flat, base


@contextmanager
def _issuing(
    kind: CollectiveKind,
    flat: torch.Tensor,
    size: int,
    group: ProcessGroup | None,
    label: str | None,
    phase: str | None,
) -> Iterator[FlightEntry | None]:
    """Around the backend call of one collective over ``flat``.

    Opens its profiler range, counts it, yields its flight-recorder entry,
    and turns a ``RuntimeError`` of the call into the named
    :class:`~shard_core.errors.CollectiveError` (see ``_diagnose.py``).
    """
    with _profiler_range(kind, label):
        nbytes = flat.numel() * flat.element_size()
        record_collective(kind, nbytes, label, size)
        entry = flight_recorder().issue(kind, label, phase, group, flat.numel(), nbytes, flat.dtype)
        try:
            yield entry
        except RuntimeError as exc:
            if isinstance(exc, CollectiveError):
                raise
            raise collective_failure(entry, exc) from exc


def _gather(
    output: torch.Tensor,
    source: torch.Tensor,
    size: int,
    group: ProcessGroup | None,
    async_op: bool,
) -> dist.Work | list[dist.Work] | None:
    """All-gather ``source`` into the flat ``output``. See [Note: All-gather on gloo]."""
    nbytes = output.numel() * output.element_size()
    if output.device.type not in _CHUNKED_GATHER_DEVICES or nbytes <= _GATHER_CHUNK_BYTES:
        single: dist.Work | None = dist.all_gather_single(
            output, source, group=group, async_op=async_op
        )
        return single
    numel = source.numel()
    rows = output.view(size, numel)
    step = max(1, _GATHER_CHUNK_BYTES // (size * output.element_size()))
    works: list[dist.Work] = []
    for start in range(0, numel, step):
        stop = min(start + step, numel)
        pieces = [rows[rank, start:stop] for rank in range(size)]
        work = dist.all_gather(pieces, source[start:stop], group=group, async_op=async_op)
        if work is not None:
            works.append(work)
    return works if async_op else None


def _issued(
    entry: FlightEntry | None,
    work: dist.Work | list[dist.Work] | None,
    finish: Callable[[], None] | None,
    async_op: bool,
) -> CommHandle:
    """The handle of an issued collective; a synchronous one is complete already."""
    if async_op and work is not None:
        return CommHandle(work, finish, entry)
    FlightRecorder.complete(entry)
    if finish is not None:
        finish()
    return _DONE


# ---------------------------------------------------------------------------
# All-gather
# ---------------------------------------------------------------------------


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: ProcessGroup | None = None,
    *,
    async_op: bool = False,
    label: str | None = None,
    phase: str | None = None,
) -> CommHandle:
    """Gather every rank's ``shard`` into the preallocated flat ``output``, in rank order.

    ``output`` is contiguous with ``group size * shard.numel()`` elements; a
    shard in another dtype is cast on the way in. With ``async_op`` the
    result is in ``output`` after the handle's ``wait()``. ``label`` (the
    unit) and ``phase`` (``"forward all-gather"``...) name it in profiles and
    in the flight recorder.
    """
    size, _ = _size_rank(group, "all_gather")
    numel = shard.numel()
    if output.numel() != numel * size:
        raise CommError(
            f"all_gather: output has {output.numel()} elements but {size} ranks each "
            f"contributing a shard of {numel} need {numel * size}; size the output as "
            "world size * shard elements"
        )
    _check_contiguous(output, "all_gather", "output")
    flat_out = output.view(-1)
    if size == 1:
        if flat_out.data_ptr() != shard.data_ptr() or flat_out.dtype != shard.dtype:
            flat_out.view(shard.shape).copy_(shard)
        return _DONE
    source, staged = _stage(shard, output.dtype, output.device)
    with _issuing("all_gather", flat_out, size, group, label, phase) as entry:
        work = _gather(flat_out, source, size, group, async_op)
    if staged is None:
        return _issued(entry, work, None, async_op)

    def finish() -> None:
        buffer_cache().release(staged)

    return _issued(entry, work, finish, async_op)


# ---------------------------------------------------------------------------
# Reduce-scatter
# ---------------------------------------------------------------------------


def _use_all_reduce(algorithm: ReduceAlgorithm, device: torch.device) -> bool:
    if algorithm == "auto":
        return device.type in _ALL_REDUCE_SCATTER_DEVICES
    if algorithm == "all_reduce":
        return True
    if algorithm == "reduce_scatter":
        return False
    raise CommError(
        f"unknown reduce-scatter algorithm {algorithm!r}; use 'auto', 'reduce_scatter' "
        "or 'all_reduce'"
    )


def _reduce_locally(
    output: torch.Tensor, grad: torch.Tensor, reduce_dtype: torch.dtype, pre: float, post: float
) -> None:
    """A world of one: the same casts and divisions, no communication."""
    if output.dtype == reduce_dtype:
        work = output.view(grad.shape)
        work.copy_(grad)
    else:
        base = buffer_cache().acquire(grad.numel(), reduce_dtype, grad.device)
        work = base[: grad.numel()].view(grad.shape)
        work.copy_(grad)
    if pre != 1.0:
        work.div_(pre)
    if post != 1.0:
        work.div_(post)
    if output.dtype != reduce_dtype:
        output.view(grad.shape).copy_(work)
        buffer_cache().release(base)


def _issue_reduce_scatter(
    source: torch.Tensor,
    rank: int,
    size: int,
    group: ProcessGroup | None,
    *,
    use_all_reduce: bool,
    into: torch.Tensor | None,
    async_op: bool,
    label: str | None,
    phase: str | None,
) -> tuple[dist.Work | None, torch.Tensor, torch.Tensor | None, FlightEntry | None]:
    """Reduce-scatter the flat, pre-divided ``source`` over ``size`` ranks; count it once.

    Returns the work, the tensor that holds (after the work) this rank's
    reduced slice, the leased staging buffer behind it, if any (to be
    released when finished), and its flight-recorder entry. The slice lands
    in ``into`` when it is given and the backend scatters natively. See
    [Note: Reduce-scatter on gloo].
    """
    n = source.numel() // size
    with _issuing("reduce_scatter", source, size, group, label, phase) as entry:
        if use_all_reduce:
            work = dist.all_reduce(source, group=group, async_op=async_op)
            return work, source[rank * n : (rank + 1) * n], None, entry
        out_base = None
        if into is None:
            out_base = buffer_cache().acquire(n, source.dtype, source.device)
            into = out_base[:n]
        work = dist.reduce_scatter_single(into, source, group=group, async_op=async_op)
        return work, into, out_base, entry


def reduce_scatter(
    output: torch.Tensor,
    grad: torch.Tensor,
    group: ProcessGroup | None = None,
    *,
    op: ReduceOpName = "sum",
    reduce_dtype: torch.dtype | None = None,
    pre_divide: float | None = None,
    post_divide: float | None = None,
    algorithm: ReduceAlgorithm = "auto",
    async_op: bool = False,
    label: str | None = None,
    phase: str | None = None,
) -> CommHandle:
    """Reduce the flat ``grad`` across ranks and leave this rank's slice in ``output``.

    ``grad`` has ``group size * output.numel()`` elements; rank ``r`` receives
    elements ``[r * n, (r + 1) * n)`` of the sum. The reduction runs in
    ``reduce_dtype`` (the gradient's dtype when ``None``); ``output`` may be
    in another dtype. ``op`` and the factors: see :func:`resolve_divide_factors`
    and [Note: Divide factors]. ``grad`` is scratch afterwards (see
    [Note: Gradients are scratch]). ``algorithm`` picks the implementation
    (see [Note: Reduce-scatter on gloo]).

    Raises:
        CommError: ``grad`` does not split into ``output``-sized pieces over
            the group, ``output`` is not contiguous, or ``op``, ``algorithm``
            or the factors are invalid.
    """
    size, rank = _size_rank(group, "reduce_scatter")
    n = output.numel()
    if grad.numel() != n * size:
        raise CommError(
            f"reduce_scatter: grad has {grad.numel()} elements but an output of {n} on "
            f"{size} ranks needs {n * size}; pad the flat gradient to a multiple of the "
            "world size and size the output as its 1/world-size slice"
        )
    _check_contiguous(output, "reduce_scatter", "output")
    pre, post = resolve_divide_factors(op, size, pre_divide, post_divide)
    rdt = grad.dtype if reduce_dtype is None else reduce_dtype
    use_all_reduce = _use_all_reduce(algorithm, grad.device)
    if size == 1:
        _reduce_locally(output, grad, rdt, pre, post)
        return _DONE
    cache = buffer_cache()
    source, in_base = _stage(grad, rdt, grad.device)
    if pre != 1.0:
        source.div_(pre)
    flat_out = output.view(-1)
    work, destination, out_base, entry = _issue_reduce_scatter(
        source,
        rank,
        size,
        group,
        use_all_reduce=use_all_reduce,
        into=flat_out if output.dtype == rdt else None,
        async_op=async_op,
        label=label,
        phase=phase,
    )

    def finish() -> None:
        if destination.data_ptr() != flat_out.data_ptr():
            if post != 1.0 and flat_out.dtype == rdt:
                torch.div(destination, post, out=flat_out)
            else:
                if post != 1.0:
                    destination.div_(post)
                flat_out.copy_(destination)
        elif post != 1.0:
            flat_out.div_(post)
        if in_base is not None:
            cache.release(in_base)
        if out_base is not None:
            cache.release(out_base)

    return _issued(entry, work, finish, async_op)


def all_reduce(
    tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    *,
    op: ReduceOpName = "sum",
    reduce_dtype: torch.dtype | None = None,
    pre_divide: float | None = None,
    post_divide: float | None = None,
    async_op: bool = False,
    label: str | None = None,
    phase: str | None = None,
) -> CommHandle:
    """Reduce ``tensor`` across ranks in place (replicas of a hybrid mesh, unsharded units).

    The reduction runs in ``reduce_dtype`` (the tensor's dtype when
    ``None``); ``op`` and the factors as in :func:`reduce_scatter`.
    """
    size, _ = _size_rank(group, "all_reduce")
    pre, post = resolve_divide_factors(op, size, pre_divide, post_divide)
    rdt = tensor.dtype if reduce_dtype is None else reduce_dtype
    cache = buffer_cache()
    work_tensor, staged = _stage(tensor, rdt, tensor.device)
    if pre != 1.0:
        work_tensor.div_(pre)
    work: dist.Work | None = None
    entry: FlightEntry | None = None
    if size > 1:
        with _issuing("all_reduce", work_tensor, size, group, label, phase) as entry:
            work = dist.all_reduce(work_tensor, group=group, async_op=async_op)

    def finish() -> None:
        if post != 1.0:
            work_tensor.div_(post)
        if staged is not None:
            tensor.copy_(work_tensor.view(tensor.shape))
            cache.release(staged)

    return _issued(entry, work, None if staged is None and post == 1.0 else finish, async_op)


def broadcast(
    tensor: torch.Tensor,
    src: int = 0,
    group: ProcessGroup | None = None,
    *,
    async_op: bool = False,
    label: str | None = None,
    phase: str | None = None,
) -> CommHandle:
    """Copy ``tensor`` of the rank whose rank in ``group`` is ``src`` to every rank, in place."""
    size, _ = _size_rank(group, "broadcast")
    if not 0 <= src < size:
        raise CommError(f"broadcast: src={src} is not a rank of a group of size {size}")
    if size == 1:
        return _DONE
    _check_contiguous(tensor, "broadcast", "tensor")
    with _issuing("broadcast", tensor, size, group, label, phase) as entry:
        work = dist.broadcast(tensor, group=group, group_src=src, async_op=async_op)
    return _issued(entry, work, None, async_op)
