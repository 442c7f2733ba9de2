"""The public surface of shard_comms: a short sorted __all__, and the plumbing beside it."""

from __future__ import annotations

import shard_comms
import shard_core.errors
from shard_comms import plumbing


def test_all_is_sorted_and_every_name_exists() -> None:
    """__all__ is sorted, has no duplicates, and each name is an attribute of the package."""
    for module in (shard_comms, plumbing):
        names = module.__all__
        assert names == sorted(set(names))
        assert [name for name in names if not hasattr(module, name)] == []


def test_the_front_door_holds_what_a_training_script_uses() -> None:
    """Init, meshes, collectives, counters, flight records, hooks and device handles are on top."""
    required = {
        "init_distributed",
        "build_mesh",
        "all_gather",
        "reduce_scatter",
        "all_reduce",
        "broadcast",
        "comm_counters",
        "count_collectives",
        "flight_recorder",
        "set_training_step",
        "DefaultGradReducer",
        "reduce_gradient",
        "resolve_comm_hook",
        "resolve_comm_codec",
        "ErrorFeedback",
        "get_device_handle",
        "buffer_cache_info",
    }
    assert required - set(shard_comms.__all__) == set()


def test_plumbing_stays_off_the_front_door() -> None:
    """What only shard's own packages use is in shard_comms.plumbing, not shard_comms.__all__."""
    assert set(plumbing.__all__) & set(shard_comms.__all__) == set()
    assert {"plan_init", "parse_launch_env", "choose_backend", "post_forward_group"} <= set(
        plumbing.__all__
    )


def test_errors_are_shard_core_classes() -> None:
    """MeshError, DistributedInitError and CommError are shard_core.errors' classes, re-exported."""
    assert shard_comms.MeshError is shard_core.errors.MeshError
    assert shard_comms.DistributedInitError is shard_core.errors.DistributedInitError
    assert shard_comms.CommError is shard_core.errors.CommError
