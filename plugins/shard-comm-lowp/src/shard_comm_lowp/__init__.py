"""fp16 and bf16 gradient compression comm hooks for shard."""

from shard_comm_lowp._version import __version__

__all__ = ["__version__"]
