"""The hook runtime of shard: ``fully_shard``, ``FullyShardedDataParallel`` and their engine.

Switch from PyTorch by changing the import line::

    from shard_runtime import fully_shard, MixedPrecisionPolicy
    from shard_runtime import FullyShardedDataParallel, ShardingStrategy
"""

from shard_core import CustomPolicy, ModuleWrapPolicy
from shard_runtime._comm import share_comm_ctx
from shard_runtime._flat_shard import FlatShard, flat_shard_placement
from shard_runtime._flat_units import FlatUnit, FlatUnitParam, flat_units, original_buffer_dtypes
from shard_runtime._fully_shard import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
)
from shard_runtime._options import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from shard_runtime._state import clean_fqn
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
from shard_runtime._wrap import (
    WrapPolicyLike,
    always_wrap_policy,
    apply_wrap_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    plan_units,
    resolve_wrap_policy,
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
    "FSDPModule",
    "FlatShard",
    "FlatUnit",
    "FlatUnitParam",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "ModuleWrapPolicy",
    "OffloadPolicy",
    "OptimStateDictConfig",
    "OptimStateKeyType",
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
    "clean_fqn",
    "enable_wrap",
    "flat_shard_placement",
    "flat_units",
    "fully_shard",
    "lambda_auto_wrap_policy",
    "original_buffer_dtypes",
    "plan_units",
    "register_fsdp_forward_method",
    "resolve_wrap_policy",
    "share_comm_ctx",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "use_shard_for_torch_fsdp",
]
