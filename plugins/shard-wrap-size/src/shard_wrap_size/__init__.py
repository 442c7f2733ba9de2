"""A wrap policy for shard that makes units by parameter count."""

from shard_wrap_size._version import __version__

__all__ = ["__version__"]
