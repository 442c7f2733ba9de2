"""The parts of shard-comms that shard's own packages build on, not users.

Public to shard's distributions (``shard-runtime``, ``shard-checkpoint``,
``shard-cli``, ``shard-testing``) and to their tests: the cached meshes and
groups the front ends derive (see ``_groups.py``), the steps of
:func:`~shard_comms.init_distributed` as plain functions (tested without a
process group), the divide-factor arithmetic of the reductions, the
staging of custom collectives, the encoded (comm codec) collectives, and
the resetters of process-wide caches and records. These names may change
with the packages that use them; a training script needs only what
``shard_comms`` itself exports.
"""

from shard_comms._buffers import clear_buffer_cache
from shard_comms._collectives import (
    ReduceAlgorithm,
    ReduceOpName,
    divide_factors,
    resolve_divide_factors,
)
from shard_comms._counters import COLLECTIVE_KINDS, CollectiveKind
from shard_comms._custom import (
    comm_buffer,
    custom_all_gather,
    custom_reduce_scatter,
    group_allocates,
)
from shard_comms._device import clear_device_handle_cache
from shard_comms._diagnose import collective_failure
from shard_comms._encoded import (
    ENCODABLE_DTYPES,
    encoded_all_gather,
    encoded_all_reduce,
    encoded_reduce_scatter,
)
from shard_comms._flight import reset_flight_recorder, set_flight_step
from shard_comms._groups import (
    PostForwardGroup,
    clear_group_cache,
    default_mesh,
    group_mesh,
    hybrid_mesh,
    joined_mesh,
    node_mesh,
    post_forward_group,
    replicated_mesh,
    separate_reduce_scatter_group,
    standalone_group_mesh,
)
from shard_comms._process_group import (
    SHARD_DEVICE_ENV,
    SHARD_STORE_ENV,
    InitPlan,
    LaunchEnv,
    choose_backend,
    parse_launch_env,
    plan_init,
    resolve_device_handle,
)

__all__ = [
    "COLLECTIVE_KINDS",
    "CollectiveKind",
    "ENCODABLE_DTYPES",
    "InitPlan",
    "LaunchEnv",
    "PostForwardGroup",
    "ReduceAlgorithm",
    "ReduceOpName",
    "SHARD_DEVICE_ENV",
    "SHARD_STORE_ENV",
    "choose_backend",
    "clear_buffer_cache",
    "clear_device_handle_cache",
    "clear_group_cache",
    "collective_failure",
    "comm_buffer",
    "custom_all_gather",
    "custom_reduce_scatter",
    "default_mesh",
    "divide_factors",
    "encoded_all_gather",
    "encoded_all_reduce",
    "encoded_reduce_scatter",
    "group_allocates",
    "group_mesh",
    "hybrid_mesh",
    "joined_mesh",
    "node_mesh",
    "parse_launch_env",
    "plan_init",
    "post_forward_group",
    "replicated_mesh",
    "reset_flight_recorder",
    "resolve_device_handle",
    "resolve_divide_factors",
    "separate_reduce_scatter_group",
    "set_flight_step",
    "standalone_group_mesh",
]
