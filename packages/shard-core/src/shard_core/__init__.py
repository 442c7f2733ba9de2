"""Flat layout, shard metadata, sharding math and the plugin registry of shard."""

from shard_core._version import __version__

__all__ = ["__version__"]
