"""Device handles for other accelerators (xpu, hpu, npu, mps) through torch.accelerator."""

from shard_device_accel._version import __version__

__all__ = ["__version__"]
