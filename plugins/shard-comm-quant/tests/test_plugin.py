"""Registration of the codecs through the ``shard_comm_codecs`` hook, in memory."""

from __future__ import annotations

import shard_comm_quant
from shard_comm_quant import BlockQuantCodec, int4_codec, int8_codec, plugin
from shard_core.plugin import Registry, make_plugin_manager


def test_plugin_registers_both_codecs_by_name() -> None:
    """A registry with this plugin registered in memory builds both codecs, with options."""
    pm = make_plugin_manager(load_entry_points=False)
    pm.register(plugin, name="comm-quant")
    registry = Registry(pm)
    assert registry.comm_codecs() == {"int4": int4_codec, "int8": int8_codec}
    codec = registry.comm_codec("int8", block_size=64)
    assert isinstance(codec, BlockQuantCodec)
    assert (codec.bits, codec.block_size) == (8, 64)
    assert registry.comm_codec("int4").bits == 4


def test_public_surface() -> None:
    """The package exports its codec class, the two factories, the default block and its version."""
    assert shard_comm_quant.__all__ == [
        "BlockQuantCodec",
        "DEFAULT_BLOCK_SIZE",
        "__version__",
        "int4_codec",
        "int8_codec",
    ]
