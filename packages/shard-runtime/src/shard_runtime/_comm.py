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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shard_comms import get_device_handle
from shard_core.protocols import DeviceHandle, StreamLike

__all__ = ["CommStreams", "streams_for"]


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
