"""Where the engine's communication runs: collectives through shard-comms, on their own streams.

Every collective a unit issues goes through shard-comms (counted, labelled
with the unit's module name for profiles and ``SHARD_DEBUG`` logs, and taking
the fastest path per backend). On an accelerator, all-gathers and
reductions are issued on two streams of their own, so they overlap the
compute stream; events order them. On the CPU the device handle's streams and
events are no-ops and the same code runs unchanged.

[Note: Stream ordering]
All-gather: the all-gather stream first waits for the compute stream (or for
the event ``set_post_optim_event`` gave), because the optimizer writes the
shards there; the copy-in and the collective run on the all-gather stream;
the compute stream waits for the collective before the copy-out. Reduction:
the reduce-scatter stream waits for the compute stream (the gradients are
computed there), copies them in and reduces; the compute stream waits for it
before the reduced shard is accumulated. Tensors allocated on one stream and
used on another are recorded with the allocator so their memory is not reused
too early.

[Note: Sharing the communication context]
Each root owns a :class:`CommContext`: the order of the reductions its units
have in flight (bounded by ``set_reduce_scatter_max_input_buffers``, one by
default, so the buffers they hold stay bounded too). The reductions
themselves are each unit's (``_reduction.py``); the context only decides
when the oldest lands. ``share_comm_ctx`` hands several roots
(pipeline stages, say) one context, so the bound holds across all of them.
The streams need no sharing: :func:`streams_for` makes one pair per device
type per process, which every unit uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from shard_comms import get_device_handle
from shard_core.protocols import DeviceHandle, StreamLike

__all__ = [
    "CommContext",
    "CommStreams",
    "InFlight",
    "streams_for",
]


@dataclass(frozen=True, slots=True)
class CommStreams:
    """The device handle and the two communication streams of one device type."""

    handle: DeviceHandle
    all_gather: StreamLike
    reduce_scatter: StreamLike

    def current(self) -> StreamLike:
        """The compute stream."""
        return self.handle.current_stream()


_STREAMS: dict[str, CommStreams] = {}


def streams_for(device: torch.device) -> CommStreams:
    """The communication streams for ``device``'s type, created once per process."""
    streams = _STREAMS.get(device.type)
    if streams is None:
        handle = get_device_handle(device.type)
        # Higher priority (lower number) lets communication kernels start ahead of compute.
        streams = CommStreams(
            handle=handle,
            all_gather=handle.new_stream(priority=-1),
            reduce_scatter=handle.new_stream(priority=-1),
        )
        _STREAMS[device.type] = streams
    return streams


class InFlight(Protocol):
    """A reduction in flight: :meth:`land` waits for it and accumulates its result, once."""

    def land(self) -> None:
        """Wait for the collective and accumulate the result (idempotent)."""
        ...


@dataclass(eq=False, slots=True)
class CommContext:
    """The reductions a root (or roots sharing it) has in flight.

    See [Note: Sharing the communication context].
    """

    in_flight: list[InFlight] = field(default_factory=list)

    def queue(self, issued: Sequence[InFlight], limit: int) -> None:
        """Add ``issued``, first landing the oldest until fewer than ``limit`` remain.

        Step 4 of [Note: the path of one gradient] in ``_reduction.py``.
        ``issued`` holds one state's reductions (one per unit: several when
        its parameters are on several meshes), which count as one against
        ``limit``, as PyTorch counts one module's parameter groups, so a
        module's units never wait for each other.
        """
        while len(self.in_flight) >= max(limit, 1):
            self.in_flight.pop(0).land()
        self.in_flight.extend(issued)

    def land(self) -> None:
        """Land every reduction in flight, oldest first (the end of a last backward)."""
        while self.in_flight:
            self.in_flight.pop(0).land()
