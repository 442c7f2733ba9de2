"""Block-quantized communication for shard: int8/int4 codecs for all-gathers and reductions."""

from shard_comm_quant._codec import DEFAULT_BLOCK_SIZE, BlockQuantCodec, int4_codec, int8_codec
from shard_comm_quant._version import __version__

__all__ = ["BlockQuantCodec", "DEFAULT_BLOCK_SIZE", "__version__", "int4_codec", "int8_codec"]
