"""The hook runtime of shard: ``fully_shard``, ``FullyShardedDataParallel`` and their engine.

Switch from PyTorch by changing the import line::

    from shard_runtime import fully_shard, MixedPrecisionPolicy
    from shard_runtime import FullyShardedDataParallel, ShardingStrategy

What shard's other packages need from the engine (flat units, key cleaning,
wrap planning) is in :mod:`shard_runtime.plumbing`, not here.
"""

from shard_core import CustomPolicy, ModuleWrapPolicy
from shard_runtime._flat_placement import FlatShard, flat_shard_placement
from shard_runtime._fully_shard import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
)
from shard_runtime._host_memory import release_host_memory, set_release_host_memory_after_backward
from shard_runtime._mesh_groups import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult
from shard_runtime._options import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from shard_runtime._share_comm_ctx import share_comm_ctx
from shard_runtime._state_dict_type import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from shard_runtime._version import __version__
from shard_runtime._wrap_policy import (
    WrapPolicyLike,
    always_wrap_policy,
    apply_wrap_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from shard_runtime._wrapper import FullyShardedDataParallel
from shard_runtime._wrapper_options import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
)
from shard_runtime.integrations import use_shard_for_torch_fsdp  # imports torch FSDP on call only

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "CPUOffloadPolicy",
    "CustomPolicy",
    "DataParallelMeshDims",
    "FSDPMeshInfo",
    "FSDPModule",
    "FlatShard",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "HSDPMeshInfo",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "ModuleWrapPolicy",
    "OffloadPolicy",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardPlacementResult",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "UnshardHandle",
    "WrapPolicyLike",
    "__version__",
    "always_wrap_policy",
    "apply_wrap_policy",
    "enable_wrap",
    "flat_shard_placement",
    "fully_shard",
    "lambda_auto_wrap_policy",
    "register_fsdp_forward_method",
    "release_host_memory",
    "set_release_host_memory_after_backward",
    "share_comm_ctx",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "use_shard_for_torch_fsdp",
]
