"""Registry hooks of this plugin: the device handle for ``"cuda"``."""

from __future__ import annotations

from shard_core import hookimpl
from shard_core.protocols import DeviceHandle
from shard_device_cuda._handle import CudaDeviceHandle

__all__ = ["CUDA_HANDLE", "shard_device_handle"]

CUDA_HANDLE = CudaDeviceHandle()
"""The one handle this plugin hands out; it holds no state of its own."""


@hookimpl
def shard_device_handle(device_type: str) -> DeviceHandle | None:
    """Answer ``"cuda"`` (even where CUDA is absent: ``is_available()`` then says so)."""
    return CUDA_HANDLE if device_type == "cuda" else None
