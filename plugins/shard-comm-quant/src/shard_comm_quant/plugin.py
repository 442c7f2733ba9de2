"""Registry hooks of this plugin: the block-quantization codecs, by name."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from shard_comm_quant._codec import int4_codec, int8_codec
from shard_core import hookimpl
from shard_core.protocols import CommCodec

__all__ = ["shard_comm_codecs"]


@hookimpl
def shard_comm_codecs() -> Mapping[str, Callable[..., CommCodec]]:
    """Register ``"int8"`` and ``"int4"`` (each takes ``block_size=``)."""
    return {"int4": int4_codec, "int8": int8_codec}
