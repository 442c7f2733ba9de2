"""Registry hooks of this plugin: device handles for xpu, hpu, npu and mps."""

from __future__ import annotations

from shard_core import hookimpl
from shard_core.protocols import DeviceHandle
from shard_device_accel._handle import accelerator_handle

__all__ = ["shard_device_handle"]


@hookimpl
def shard_device_handle(device_type: str) -> DeviceHandle | None:
    """Answer a present accelerator type of ``ACCELERATOR_TYPES``; never cpu or cuda."""
    return accelerator_handle(device_type)
