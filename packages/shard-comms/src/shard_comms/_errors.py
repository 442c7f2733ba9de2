"""The exceptions only the communication layer raises.

Both derive from :class:`shard_core.errors.ShardError` and from the built-in
exception a Python user would expect, like every error shard raises.
"""

from __future__ import annotations

from shard_core.errors import ShardError

__all__ = ["DistributedInitError", "MeshError"]


class MeshError(ShardError, ValueError):
    """A device mesh cannot be built as asked (shape, groups, node size, axis names)."""


class DistributedInitError(ShardError, RuntimeError):
    """``init_distributed`` cannot do what was asked.

    A launch environment that is incomplete or malformed, or a second call
    that conflicts with the process group that already exists.
    """
