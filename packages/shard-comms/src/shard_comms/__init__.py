"""Meshes, process groups, collectives, comm hooks and device handles of shard.

The runtime calls these on every step: :func:`all_gather` and
:func:`reduce_scatter` over flat buffers (several tensors in one call with the
``_many`` forms), :func:`all_reduce` across replicas, counted by
:func:`count_collectives` and recorded by the flight recorder
(:func:`flight_recorder`), whose records name a failed collective
(:class:`CollectiveError`). A training script calls :func:`init_distributed`
once and :func:`build_mesh` to describe its data-parallel layout.
"""

from shard_comms._buffers import BufferCacheInfo, buffer_cache_info, clear_buffer_cache
from shard_comms._collectives import (
    CommHandle,
    ReduceAlgorithm,
    ReduceOpName,
    all_gather,
    all_gather_many,
    all_reduce,
    broadcast,
    default_divide_factors,
    reduce_scatter,
    reduce_scatter_many,
    resolve_divide_factors,
)
from shard_comms._counters import (
    COLLECTIVE_KINDS,
    CollectiveKind,
    CollectiveStats,
    CommCounts,
    comm_counters,
    count_collectives,
    reset_comm_counters,
)
from shard_comms._custom import (
    CustomAllGather,
    CustomReduceScatter,
    comm_buffer,
    custom_all_gather,
    custom_reduce_scatter,
    group_allocates,
)
from shard_comms._device import clear_device_handle_cache, get_device_handle
from shard_comms._diagnose import format_flight_table, load_flight_dump
from shard_comms._flight import (
    FlightEntry,
    FlightRecorder,
    flight_recorder,
    reset_flight_recorder,
    set_flight_step,
)
from shard_comms._hooks import (
    DefaultGradReducer,
    default_comm_hook,
    reduce_gradient,
    resolve_comm_hook,
)
from shard_comms._init import (
    DistributedState,
    InitPlan,
    LaunchEnv,
    choose_backend,
    init_distributed,
    parse_launch_env,
    plan_init,
)
from shard_comms._mesh import build_mesh, mesh_groups
from shard_comms._version import __version__
from shard_core.errors import CollectiveError, CommError, DistributedInitError, MeshError

__all__ = [
    "BufferCacheInfo",
    "COLLECTIVE_KINDS",
    "CollectiveError",
    "CollectiveKind",
    "CollectiveStats",
    "CommCounts",
    "CommError",
    "CommHandle",
    "CustomAllGather",
    "CustomReduceScatter",
    "DefaultGradReducer",
    "DistributedInitError",
    "DistributedState",
    "FlightEntry",
    "FlightRecorder",
    "InitPlan",
    "LaunchEnv",
    "MeshError",
    "ReduceAlgorithm",
    "ReduceOpName",
    "__version__",
    "all_gather",
    "all_gather_many",
    "all_reduce",
    "broadcast",
    "buffer_cache_info",
    "build_mesh",
    "choose_backend",
    "clear_buffer_cache",
    "clear_device_handle_cache",
    "comm_buffer",
    "comm_counters",
    "count_collectives",
    "custom_all_gather",
    "custom_reduce_scatter",
    "default_comm_hook",
    "default_divide_factors",
    "flight_recorder",
    "format_flight_table",
    "get_device_handle",
    "group_allocates",
    "init_distributed",
    "load_flight_dump",
    "mesh_groups",
    "parse_launch_env",
    "plan_init",
    "reduce_gradient",
    "reduce_scatter",
    "reduce_scatter_many",
    "reset_comm_counters",
    "reset_flight_recorder",
    "resolve_comm_hook",
    "resolve_divide_factors",
    "set_flight_step",
]
