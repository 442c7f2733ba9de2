"""The errors of the accelerator device handles.

Both derive from :class:`shard_core.errors.ShardError` and from the built-in
exception a caller would expect, like every error shard raises on purpose.
"""

from __future__ import annotations

from shard_core.errors import ShardError

__all__ = ["DeviceMismatchError", "DeviceUnavailableError"]


class DeviceUnavailableError(ShardError, RuntimeError):
    """The handle was asked for device work that this process or torch build cannot do."""


class DeviceMismatchError(ShardError, ValueError):
    """A device, tensor, stream or event of another device type was handed to the handle."""
