"""Comm codecs through the registry: the ``shard_comm_codecs`` hook and ``Registry.comm_codec``."""

from __future__ import annotations

import re

import pytest
import torch

from shard_core import PluginWarning, Registry, hookimpl, make_plugin_manager
from shard_core.errors import PluginCollisionError, PluginError, UnknownPluginNameError
from shard_core.protocols import CommCodec


class CopyCodec:
    """A codec that sends float32 values as their bytes: the smallest real CommCodec."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def encoded_nbytes(self, numel: int) -> int:
        return 4 * numel

    def encode(
        self, values: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None
    ) -> None:
        out.view(torch.float32).copy_(values * self.scale)

    def decode(self, encoded: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(encoded.view(torch.float32) / self.scale)


class Codecs:
    def __init__(self, answer: object) -> None:
        self.answer = answer

    @hookimpl
    def shard_comm_codecs(self) -> object:
        return self.answer


def registry(**plugins: object) -> Registry:
    pm = make_plugin_manager(load_entry_points=False)
    for name, plugin in plugins.items():
        pm.register(plugin, name=name)
    return Registry(pm)


def test_copy_codec_is_a_comm_codec() -> None:
    """The test double satisfies the CommCodec protocol, so the tests exercise the contract."""
    assert isinstance(CopyCodec(), CommCodec)
    assert not isinstance(object(), CommCodec)


def test_no_codec_is_built_in() -> None:
    """A fresh registry has no comm codec: they come from plugins (shard-comm-quant)."""
    assert registry().comm_codecs() == {}


def test_comm_codec_builds_a_fresh_codec_with_options() -> None:
    """comm_codec(name, **options) calls the registered factory with the options, every time."""
    reg = registry(quant=Codecs({"copy": CopyCodec}))
    assert reg.comm_codecs() == {"copy": CopyCodec}
    first = reg.comm_codec("copy", scale=2.0)
    assert isinstance(first, CopyCodec)
    assert first.scale == 2.0
    assert reg.comm_codec("copy") is not first


def test_unknown_comm_codec_lists_registered_names() -> None:
    """An unknown name lists the registered codecs and suggests the closest one; a name of
    shard's own plugins names the distribution to install."""
    with pytest.raises(
        UnknownPluginNameError,
        match=r"^no comm codec is registered as 'int8'; registered: none. 'int8' is provided by "
        r"shard-comm-quant: install it from the shard repository \(pip install "
        r"\./plugins/shard-comm-quant in a checkout",
    ):
        registry().comm_codec("int8")
    reg = registry(quant=Codecs({"int8": CopyCodec, "int4": CopyCodec}))
    with pytest.raises(
        UnknownPluginNameError,
        match=r"^no comm codec is registered as 'int9'; registered: 'int4', 'int8'. "
        r"Did you mean 'int8'\?$",
    ):
        reg.comm_codec("int9")


def test_factory_building_a_non_codec_is_a_plugin_error() -> None:
    """A factory whose product lacks encode/decode is blamed on its plugin."""
    reg = registry(sloppy=Codecs({"broken": lambda: 42}))
    with pytest.raises(
        PluginError,
        match=r"^comm codec 'broken' of plugin 'sloppy' built 42 \(int\), which is not a "
        r"CommCodec \(it needs encoded_nbytes\(\), encode\(\) and decode\(\)\); report this "
        r"to the plugin's authors$",
    ):
        reg.comm_codec("broken")


def test_two_plugins_claiming_a_codec_name_collide() -> None:
    """The same codec name from two plugins disables that name, saying so once, and the
    lookup names both (the registry's rule for every named hook)."""
    reg = registry(a=Codecs({"int8": CopyCodec}), b=Codecs({"int8": CopyCodec}))
    with pytest.warns(PluginWarning, match="^comm codec 'int8' is registered by both plugin"):
        assert reg.comm_codecs() == {}
    with pytest.raises(PluginCollisionError) as info:
        reg.comm_codec("int8")
    assert str(info.value) == (
        "comm codec 'int8' is registered by both plugin 'a' and plugin 'b', so it is disabled: "
        "names must be unique across plugins. Register the name in one plugin only."
    )


def test_malformed_codecs_are_skipped_with_a_warning() -> None:
    """An entry whose value is not callable is skipped; the other plugins' entries are kept."""
    reg = registry(odd=Codecs({"int8": "nope"}), good=Codecs({"copy": CopyCodec}))
    message = (
        "plugin 'odd' returned malformed entries from shard_comm_codecs(): 'int8' maps to "
        "'nope' (str), which is not callable; this entry was skipped. Report this to the "
        "plugin's authors."
    )
    with pytest.warns(PluginWarning, match=f"^{re.escape(message)}$"):
        assert list(reg.comm_codecs()) == ["copy"]
