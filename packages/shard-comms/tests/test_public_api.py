"""The public surface of shard_comms: a sorted __all__ of names that exist."""

from __future__ import annotations

import shard_comms
import shard_core.errors


def test_all_is_sorted_and_every_name_exists() -> None:
    """__all__ is sorted, has no duplicates, and each name is an attribute of the package."""
    names = shard_comms.__all__
    assert names == sorted(set(names))
    assert [name for name in names if not hasattr(shard_comms, name)] == []


def test_the_names_the_runtime_relies_on_are_public() -> None:
    """The mesh, init, collective, counter, reducer and device-handle entry points are exported."""
    required = {
        "build_mesh",
        "init_distributed",
        "all_gather",
        "all_gather_many",
        "reduce_scatter",
        "reduce_scatter_many",
        "all_reduce",
        "broadcast",
        "comm_counters",
        "reset_comm_counters",
        "count_collectives",
        "DefaultGradReducer",
        "reduce_gradient",
        "resolve_comm_hook",
        "get_device_handle",
        "clear_buffer_cache",
    }
    assert required - set(shard_comms.__all__) == set()


def test_errors_are_shard_core_classes() -> None:
    """MeshError, DistributedInitError and CommError are shard_core.errors' classes, re-exported."""
    assert shard_comms.MeshError is shard_core.errors.MeshError
    assert shard_comms.DistributedInitError is shard_core.errors.DistributedInitError
    assert shard_comms.CommError is shard_core.errors.CommError
