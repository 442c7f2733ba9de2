"""The hook runtime of shard: ``fully_shard`` and its engine.

Switch from PyTorch by changing the import line::

    from shard_runtime import fully_shard, MixedPrecisionPolicy
"""

from shard_runtime._fully_shard import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
)
from shard_runtime._options import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from shard_runtime._version import __version__

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "__version__",
    "fully_shard",
    "register_fsdp_forward_method",
]
