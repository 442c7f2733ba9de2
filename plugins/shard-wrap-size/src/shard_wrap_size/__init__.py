"""A wrap policy for shard that makes units by parameter count.

``SizeWrapPolicy`` is PyTorch's ``size_based_auto_wrap_policy`` as a shard
wrap policy, registered as ``"size"``.
"""

from shard_wrap_size._policy import (
    DEFAULT_EXCLUDE_WRAP_MODULES,
    DEFAULT_FORCE_LEAF_MODULES,
    SizeWrapPolicy,
)
from shard_wrap_size._version import __version__

__all__ = [
    "DEFAULT_EXCLUDE_WRAP_MODULES",
    "DEFAULT_FORCE_LEAF_MODULES",
    "SizeWrapPolicy",
    "__version__",
]
