"""A wrap policy for shard that makes each transformer block a unit.

``TransformerBlockPolicy``, registered as ``"transformer"``, wraps the block
classes it is given, or detects the block class of the model it plans.
"""

from shard_wrap_transformer._detect import BlockList, detect_block_class, find_block_list
from shard_wrap_transformer._policy import TransformerBlockPolicy
from shard_wrap_transformer._version import __version__

__all__ = [
    "BlockList",
    "TransformerBlockPolicy",
    "__version__",
    "detect_block_class",
    "find_block_list",
]
