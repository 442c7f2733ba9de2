"""A minimal third-party wrap-policy plugin for shard.

It wraps the modules whose qualified name matches a regular expression, and
is the example README.md teaches plugin authors from.
"""

from shard_wrap_example._policy import NamePatternPolicy
from shard_wrap_example._version import __version__

__all__ = ["NamePatternPolicy", "__version__"]
