"""A wrap policy for shard that makes each transformer block a unit, detecting the block class when none is given."""

from shard_wrap_transformer._version import __version__

__all__ = ["__version__"]
