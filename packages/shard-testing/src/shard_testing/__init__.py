"""A pytest plugin for fast multi-rank tests: a persistent pool of gloo ranks and parity helpers."""

from shard_testing._version import __version__

__all__ = ["__version__"]
