"""Device handles for other accelerators (xpu, hpu, npu, mps) through torch.accelerator."""

from shard_core.errors import DeviceMismatchError, DeviceUnavailableError
from shard_device_accel._handle import (
    ACCELERATOR_TYPES,
    MEMORY_STAT_KEYS,
    AcceleratorDeviceHandle,
    AcceleratorType,
    accelerator_handle,
)
from shard_device_accel._stream import AcceleratorEvent, AcceleratorStream
from shard_device_accel._version import __version__

__all__ = [
    "ACCELERATOR_TYPES",
    "AcceleratorDeviceHandle",
    "AcceleratorEvent",
    "AcceleratorStream",
    "AcceleratorType",
    "DeviceMismatchError",
    "DeviceUnavailableError",
    "MEMORY_STAT_KEYS",
    "__version__",
    "accelerator_handle",
]
