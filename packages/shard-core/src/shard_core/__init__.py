"""Flat layout, shard metadata, sharding math, what a rank holds, and the plugin registry."""

from shard_core._cpu import CpuDeviceHandle
from shard_core._dim0 import contiguous_stride, dim0_chunk_range, padded_dim0_size
from shard_core._held import StateBytes, held_bytes, state_bytes
from shard_core._layout import FlatLayout, ParamShardInfo, ParamSpec, ShardMetadata
from shard_core._policies import (
    CustomPolicy,
    LambdaWrapPolicy,
    ModuleClasses,
    ModuleWrapPolicy,
    as_module_classes,
)
from shard_core._version import __version__
from shard_core._wrap_plan import WrapTarget, plan_wraps
from shard_core.errors import PluginWarning, WrapPlanError
from shard_core.plugin import (
    Registry,
    get_plugin_manager,
    get_registry,
    hookimpl,
    make_plugin_manager,
    reset_plugin_manager,
)

__all__ = [
    "CpuDeviceHandle",
    "CustomPolicy",
    "FlatLayout",
    "LambdaWrapPolicy",
    "ModuleClasses",
    "ModuleWrapPolicy",
    "ParamShardInfo",
    "ParamSpec",
    "PluginWarning",
    "Registry",
    "ShardMetadata",
    "StateBytes",
    "WrapPlanError",
    "WrapTarget",
    "__version__",
    "as_module_classes",
    "contiguous_stride",
    "dim0_chunk_range",
    "get_plugin_manager",
    "get_registry",
    "held_bytes",
    "hookimpl",
    "make_plugin_manager",
    "padded_dim0_size",
    "plan_wraps",
    "reset_plugin_manager",
    "state_bytes",
]
