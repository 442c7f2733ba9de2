"""Registration of the compression hooks through the ``shard_comm_hooks`` hook, in memory."""

from __future__ import annotations

import shard_comm_lowp
from shard_comm_lowp import bf16_compress, fp16_compress, plugin
from shard_core.plugin import Registry, make_plugin_manager


def test_plugin_registers_both_hooks_by_name() -> None:
    """A registry with this plugin registered in memory finds both hooks by name."""
    pm = make_plugin_manager(load_entry_points=False)
    pm.register(plugin, name="comm-lowp")
    registry = Registry(pm)
    assert registry.comm_hook("bf16_compress") is bf16_compress
    assert registry.comm_hook("fp16_compress") is fp16_compress
    assert {"bf16_compress", "fp16_compress"} <= set(registry.comm_hooks())


def test_public_surface() -> None:
    """The package exports exactly its hook class, the two hooks and its version."""
    assert shard_comm_lowp.__all__ == [
        "LowPrecisionCompressHook",
        "__version__",
        "bf16_compress",
        "fp16_compress",
    ]
