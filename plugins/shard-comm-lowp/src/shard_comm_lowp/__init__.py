"""fp16 and bf16 gradient compression comm hooks for shard."""

from shard_comm_lowp._compress import LowPrecisionCompressHook, bf16_compress, fp16_compress
from shard_comm_lowp._version import __version__

__all__ = ["LowPrecisionCompressHook", "__version__", "bf16_compress", "fp16_compress"]
