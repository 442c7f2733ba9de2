"""A minimal third-party wrap-policy plugin for shard: wrap modules whose qualified name matches a pattern."""

from shard_wrap_example._version import __version__

__all__ = ["__version__"]
