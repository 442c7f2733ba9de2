"""The CUDA device handle for shard: streams, events, memory statistics."""

from shard_core.errors import DeviceMismatchError, DeviceUnavailableError
from shard_device_cuda._handle import MEMORY_STAT_KEYS, CudaDeviceHandle
from shard_device_cuda._stream import CudaEvent, CudaStream
from shard_device_cuda._version import __version__

__all__ = [
    "CudaDeviceHandle",
    "CudaEvent",
    "CudaStream",
    "DeviceMismatchError",
    "DeviceUnavailableError",
    "MEMORY_STAT_KEYS",
    "__version__",
]
