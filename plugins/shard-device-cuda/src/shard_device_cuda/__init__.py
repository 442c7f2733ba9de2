"""The CUDA device handle for shard: streams, events, memory statistics."""

from shard_device_cuda._version import __version__

__all__ = ["__version__"]
