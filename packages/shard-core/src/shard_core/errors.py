"""The exceptions shard raises.

Every error shard raises on bad input derives from :class:`ShardError` and
from the built-in exception a Python user would expect (``ValueError`` for a
bad argument, ``LookupError`` for an unknown name...), so existing ``except``
clauses keep working. Messages name the culprit (module, parameter, plugin)
and say what to do instead.
"""

from __future__ import annotations

__all__ = [
    "LayoutError",
    "PluginCollisionError",
    "PluginError",
    "ShardError",
    "UnknownPluginNameError",
]


class ShardError(Exception):
    """Base class of every exception shard raises on purpose."""


class LayoutError(ShardError, ValueError):
    """Parameters cannot be laid out as asked (dtype, device, shape, contiguity)."""


class PluginError(ShardError, RuntimeError):
    """A plugin broke the registry's rules."""


class PluginCollisionError(PluginError):
    """Two plugins registered the same name for the same kind of extension."""


class UnknownPluginNameError(ShardError, LookupError):
    """A wrap policy, comm hook or device type was asked for by a name nobody registered.

    The message lists the names that are registered, or the distribution to
    install for a device type.
    """

    def __str__(self) -> str:
        # LookupError would quote the message like a dict key.
        return str(self.args[0]) if self.args else ""
