"""Meshes, process groups, collectives, comm hooks and device handles of shard.

A training script calls :func:`init_distributed` once and :func:`build_mesh`
to describe its data-parallel layout. The runtime calls the collectives
(:func:`all_gather`, :func:`reduce_scatter`, :func:`all_reduce`,
:func:`broadcast`) on every step; :func:`count_collectives` counts them and
the flight recorder (:func:`flight_recorder`) records them, so that a failed
one raises a :class:`CollectiveError` naming every rank's last collective.
Comm codecs (:func:`resolve_comm_codec`, a plugin's ``"int8"``) encode what
the collectives send.

What only shard's own packages use (cached groups, the steps of
``init_distributed``, cache resetters) lives in :mod:`shard_comms.plumbing`.
"""

from shard_comms._buffers import BufferCacheInfo, buffer_cache_info
from shard_comms._collectives import CommHandle, all_gather, all_reduce, broadcast, reduce_scatter
from shard_comms._counters import (
    CollectiveStats,
    CommCounts,
    comm_counters,
    count_collectives,
    reset_comm_counters,
)
from shard_comms._custom import CustomAllGather, CustomReduceScatter
from shard_comms._device import get_device_handle
from shard_comms._diagnose import format_flight_table, load_flight_dump
from shard_comms._encoded import CodecSpec, ErrorFeedback, resolve_comm_codec
from shard_comms._flight import FlightEntry, FlightRecorder, flight_recorder, set_training_step
from shard_comms._groups import mesh_groups
from shard_comms._hooks import (
    DefaultGradReducer,
    default_comm_hook,
    reduce_gradient,
    resolve_comm_hook,
)
from shard_comms._mesh import build_mesh
from shard_comms._process_group import DistributedState, init_distributed
from shard_comms._version import __version__
from shard_core.errors import CollectiveError, CommError, DistributedInitError, MeshError

__all__ = [
    "BufferCacheInfo",
    "CodecSpec",
    "CollectiveError",
    "CollectiveStats",
    "CommCounts",
    "CommError",
    "CommHandle",
    "CustomAllGather",
    "CustomReduceScatter",
    "DefaultGradReducer",
    "DistributedInitError",
    "DistributedState",
    "ErrorFeedback",
    "FlightEntry",
    "FlightRecorder",
    "MeshError",
    "__version__",
    "all_gather",
    "all_reduce",
    "broadcast",
    "buffer_cache_info",
    "build_mesh",
    "comm_counters",
    "count_collectives",
    "default_comm_hook",
    "flight_recorder",
    "format_flight_table",
    "get_device_handle",
    "init_distributed",
    "load_flight_dump",
    "mesh_groups",
    "reduce_gradient",
    "reduce_scatter",
    "reset_comm_counters",
    "resolve_comm_codec",
    "resolve_comm_hook",
    "set_training_step",
]
