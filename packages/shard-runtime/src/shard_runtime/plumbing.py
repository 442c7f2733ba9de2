"""The parts of shard-runtime that shard's own packages build on, not users.

Public to shard's distributions (``shard-checkpoint``, ``shard-cli``) and to
their tests: what state-dict and checkpoint code needs to know about the
units of both front ends (the wrapper's flat units and their parameters'
keys, ``fully_shard``'s flat-sharded parameters and their conversions, the
buffers' original dtypes, clean parameter names, DTensors built from this
rank's piece, which tensors are users' subclasses, walking a wrapped model
with ``nn.Module.state_dict`` as plain modules, keeping meta-device ties
through a load) and the wrap planning that
``shard plan`` repeats without a process group. These names may change with
the packages that use them; a training script needs only what
``shard_runtime`` itself exports (as ``shard_comms.plumbing`` is to
``shard_comms``).
"""

from shard_runtime._all_gather_extension import is_tensor_subclass
from shard_runtime._dtensor import contiguous_dtensor
from shard_runtime._flat_placement import (
    flat_sharded_params,
    flat_to_rows,
    full_to_flat,
    is_flat_layout,
)
from shard_runtime._meta_ties import meta_tie_groups, retie
from shard_runtime._param import ShardedParam
from shard_runtime._state_dict_type import raw_module_state_dicts
from shard_runtime._wrap_policy import plan_units, resolve_wrap_policy
from shard_runtime._wrapper_names import clean_fqn
from shard_runtime._wrapper_unit_view import (
    FlatUnit,
    FlatUnitParam,
    flat_units,
    original_buffer_dtypes,
)

__all__ = [
    "FlatUnit",
    "FlatUnitParam",
    "ShardedParam",
    "clean_fqn",
    "contiguous_dtensor",
    "flat_sharded_params",
    "flat_to_rows",
    "flat_units",
    "full_to_flat",
    "is_flat_layout",
    "is_tensor_subclass",
    "meta_tie_groups",
    "original_buffer_dtypes",
    "plan_units",
    "raw_module_state_dicts",
    "resolve_wrap_policy",
    "retie",
]
