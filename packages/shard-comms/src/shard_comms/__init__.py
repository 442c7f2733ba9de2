"""Meshes, process groups, collectives, comm hooks and device handles of shard."""

from shard_comms._version import __version__

__all__ = ["__version__"]
