"""Collectives run through a user's communication object, and buffers from the group's allocator.

PyTorch's ``fully_shard`` lets a user replace one unit's all-gather or
reduce-scatter by an object with two methods: ``allocate(size, *, dtype,
device)`` says where the collective's buffers live (a memory pool, a
registered region), ``__call__(output_tensor, input_tensor, group, ...)`` runs
the collective. :func:`custom_all_gather` and :func:`custom_reduce_scatter`
call such an object the way shard's own collectives run: buffers come from
the object, the call is counted under the unit's label and opens the same
profiler range, and the result comes back as a :class:`CommHandle`.

[Note: Custom reductions sum]
A custom reduce-scatter is called with ``ReduceOp.SUM`` and shard divides
before and after the call, as it does for its own collectives: gloo has no
``PREMUL_SUM`` and not every backend averages, so one rule works everywhere.
An object that forwards ``op`` to ``torch.distributed`` produces the same
gradients as under PyTorch, up to where the division rounds.

[Note: Process-group buffers]
Some backends (NCCL) can hand out memory registered with the communicator,
which lets them copy without staging (zero-copy over NVLink SHARP or
InfiniBand). :func:`comm_buffer` asks the group's backend for such memory and
falls back to an ordinary allocation when the backend has none (gloo: never),
so the same call is right on every device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from shard_comms._collectives import CommHandle, _profiler_range
from shard_comms._counters import record_collective
from shard_core.errors import CommError

__all__ = [
    "CustomAllGather",
    "CustomReduceScatter",
    "comm_buffer",
    "custom_all_gather",
    "custom_reduce_scatter",
    "group_allocates",
]


class _Allocates(Protocol):
    """Where a user's collective wants its buffers: the method both collectives share."""

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A tensor of ``size`` for the collective (the runtime asks for 1-D sizes)."""
        ...


class CustomAllGather(_Allocates, Protocol):
    """A user's all-gather (PyTorch's ``AllGather`` shape): where buffers live, and the call."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Gather every rank's ``input_tensor`` into ``output_tensor``, in rank order."""
        ...


class CustomReduceScatter(_Allocates, Protocol):
    """A user's reduce-scatter (PyTorch's ``ReduceScatter`` shape): buffers, and the call."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Reduce ``input_tensor`` with ``op`` and leave this rank's slice in ``output_tensor``."""
        ...


def group_allocates(group: ProcessGroup, device: torch.device) -> bool:
    """Whether ``group``'s backend on ``device`` hands out communication memory.

    See [Note: Process-group buffers].
    """
    try:
        backend = group._get_backend(device)
    except RuntimeError:  # no backend for this device type
        return False
    return bool(backend.supports_tensor_alloc(device))


def comm_buffer(
    numel: int, dtype: torch.dtype, device: torch.device, group: ProcessGroup | None = None
) -> torch.Tensor:
    """A 1-D buffer of ``numel`` for a collective, from ``group``'s allocator where it has one.

    See [Note: Process-group buffers]; ``group=None`` allocates ordinarily.
    """
    if group is not None and group_allocates(group, device):
        backend = group._get_backend(device)
        buffer = backend.allocate_tensor(numel, dtype=dtype, device=device)
        assert isinstance(buffer, torch.Tensor)
        return buffer
    return torch.empty(numel, dtype=dtype, device=device)


def _checked(buffer: object, numel: int, what: str, comm: object) -> torch.Tensor:
    if not isinstance(buffer, torch.Tensor) or buffer.numel() != numel:
        got = (
            f"a tensor of {buffer.numel()} elements"
            if isinstance(buffer, torch.Tensor)
            else type(buffer).__name__
        )
        raise CommError(
            f"{type(comm).__name__}.allocate returned {got} for the {what} of {numel} "
            "elements; allocate must return a tensor of the requested size"
        )
    return buffer.view(-1)


def custom_all_gather(
    comm: CustomAllGather,
    shard: torch.Tensor,
    group: ProcessGroup,
    *,
    async_op: bool = False,
    label: str | None = None,
) -> tuple[torch.Tensor, CommHandle]:
    """Gather every rank's 1-D ``shard`` through ``comm``; returns the output and its handle.

    The output (``group size * shard.numel()`` elements) comes from
    ``comm.allocate``; this rank's shard is copied into its own slot of it and
    that slot is the call's input (an in-place all-gather, as PyTorch issues
    it), so a comm that allocates registered memory sends from it too.
    """
    size, rank = group.size(), group.rank()
    numel = shard.numel()
    output = _checked(
        comm.allocate((size * numel,), dtype=shard.dtype, device=shard.device),
        size * numel,
        "all-gather output",
        comm,
    )
    own = output.narrow(0, rank * numel, numel)
    own.copy_(shard.view(-1))
    if size == 1:
        return output, CommHandle(None, None)
    with _profiler_range("all_gather", label):
        record_collective("all_gather", output.numel() * output.element_size(), label, size)
        work = comm(output_tensor=output, input_tensor=own, group=group, async_op=async_op)
    handle = CommHandle(work, None)
    if not async_op:
        handle.wait()
    return output, handle


def custom_reduce_scatter(
    comm: CustomReduceScatter,
    grad: torch.Tensor,
    group: ProcessGroup,
    *,
    pre_divide: float = 1.0,
    post_divide: float = 1.0,
    label: str | None = None,
) -> tuple[torch.Tensor, CommHandle]:
    """Reduce-scatter the flat ``grad`` through ``comm``; returns this rank's slice and a handle.

    Input and output come from ``comm.allocate`` (``grad`` is copied in,
    divided by ``pre_divide``); ``comm`` is called with ``ReduceOp.SUM`` and
    the handle's ``wait`` divides the output by ``post_divide``. See
    [Note: Custom reductions sum].
    """
    size = group.size()
    if grad.numel() % size:
        raise CommError(
            f"custom_reduce_scatter: grad has {grad.numel()} elements, not a multiple of the "
            f"group size {size}; pad the flat gradient to a multiple of the world size"
        )
    n = grad.numel() // size
    output = _checked(
        comm.allocate((n,), dtype=grad.dtype, device=grad.device), n, "reduce-scatter output", comm
    )
    if size == 1:
        torch.div(grad.view(-1), pre_divide * post_divide, out=output)
        return output, CommHandle(None, None)
    source = _checked(
        comm.allocate((grad.numel(),), dtype=grad.dtype, device=grad.device),
        grad.numel(),
        "reduce-scatter input",
        comm,
    )
    if pre_divide != 1.0:
        torch.div(grad.view(-1), pre_divide, out=source)
    else:
        source.copy_(grad.view(-1))
    with _profiler_range("reduce_scatter", label):
        record_collective("reduce_scatter", source.numel() * source.element_size(), label, size)
        work = comm(output_tensor=output, input_tensor=source, group=group, op=dist.ReduceOp.SUM)

    keep_alive = [source]  # the input lives until the collective completed

    def finish() -> None:
        keep_alive.clear()
        if post_divide != 1.0:
            output.div_(post_divide)

    return output, CommHandle(work, finish)
