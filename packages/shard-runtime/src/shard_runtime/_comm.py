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
Each root owns a :class:`CommContext`: the reductions it has in flight
(bounded by ``set_reduce_scatter_max_input_buffers``, one by default, so the
buffers they hold stay bounded too). ``share_comm_ctx`` hands several roots
(pipeline stages, say) one context, so the bound holds across all of them.
The streams need no sharing: :func:`streams_for` makes one pair per device
type per process, which every unit uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from shard_comms import get_device_handle
from shard_core.protocols import DeviceHandle, StreamLike

if TYPE_CHECKING:
    from shard_runtime._fully_shard import FSDPModule

__all__ = [
    "CommContext",
    "CommStreams",
    "InFlight",
    "separate_reduce_scatter_group",
    "share_comm_ctx",
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
    """A reduction in flight: :meth:`finish` waits for it and lands its result, once."""

    def finish(self) -> None:
        """Wait for the collective and accumulate the result (idempotent)."""
        ...


@dataclass(eq=False, slots=True)
class CommContext:
    """The reductions a root (or roots sharing it) has in flight.

    See [Note: Sharing the communication context].
    """

    in_flight: list[InFlight] = field(default_factory=list)

    def queue(self, pending: InFlight | None, limit: int) -> None:
        """Add ``pending``, first finishing the oldest until fewer than ``limit`` remain.

        ``None`` finishes everything (the end of backward).
        """
        bound = max(limit, 1) if pending is not None else 0
        while len(self.in_flight) >= bound and self.in_flight:
            self.in_flight.pop(0).finish()
        if pending is not None:
            self.in_flight.append(pending)


# Keyed by the ranks and the default group, so a re-initialised process group starts afresh.
_SEPARATE_GROUPS: dict[tuple[tuple[int, ...], int], dist.ProcessGroup] = {}


def separate_reduce_scatter_group(shard_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A second process group over ``shard_group``'s ranks, for reduce-scatters only.

    One per set of ranks per process, created the first time it is asked
    for; only the member ranks take part (``use_local_synchronization``), so
    on a 2-D mesh each replica's shard ranks create their own.
    """
    ranks = tuple(dist.get_process_group_ranks(shard_group))
    key = (ranks, id(dist.group.WORLD))
    group = _SEPARATE_GROUPS.get(key)
    if group is None:
        group = dist.new_group(
            list(ranks), use_local_synchronization=True, group_desc="shard_reduce_scatter"
        )
        assert group is not None  # every caller is a member
        _SEPARATE_GROUPS[key] = group
    return group


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Give the roots ``modules`` (``fully_shard``-ed, e.g. pipeline stages) one comm context.

    Their reductions in flight then share one bound (see [Note: Sharing the
    communication context]); the communication streams are already one pair
    per device type per process. An empty list does nothing.

    Raises:
        ValueError: an element is not a module ``fully_shard`` was applied to.
    """
    # Imported here: the front end and the states import this module.
    from shard_runtime._fully_shard import FSDPModule
    from shard_runtime._state import UnitState, get_state, states_in

    states: list[UnitState] = []
    for module in modules:
        state = get_state(module) if isinstance(module, torch.nn.Module) else None
        if not isinstance(module, FSDPModule) or state is None:
            raise ValueError(
                f"share_comm_ctx: expects a list of FSDPModules (modules fully_shard was "
                f"applied to) but got {type(module).__name__}; call fully_shard on it first"
            )
        states.append(state)
    if not states:
        return
    shared = states[0].unit.comm_ctx
    for state in states_in([module for root in states for module in root.modules]):
        pending = state.unit.comm_ctx
        if pending is not shared:
            for reduction in pending.in_flight:
                reduction.finish()
            pending.in_flight.clear()
            state.unit.comm_ctx = shared
