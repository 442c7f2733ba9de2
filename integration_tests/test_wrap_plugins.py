"""The wrap-policy plugins, found through their real entry points, and the registry's errors."""

from __future__ import annotations

import re
import types
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from torch import nn

import shard_wrap_example
import shard_wrap_size
import shard_wrap_size.plugin
import shard_wrap_transformer
import shard_wrap_transformer.plugin
from shard_core import (
    PluginWarning,
    get_plugin_manager,
    get_registry,
    hookimpl,
    plan_wraps,
    reset_plugin_manager,
)
from shard_core.errors import (
    PluginCallError,
    PluginCollisionError,
    UnknownPluginNameError,
    WrapPlanError,
)
from shard_core.plugin import PluginOrigin
from shard_core.plugin._manager import ShardPluginManager
from shard_wrap_size import SizeWrapPolicy
from shard_wrap_transformer import TransformerBlockPolicy

SWITCHES = ("SHARD_DISABLE_PLUGINS", "SHARD_LOAD_PLUGINS", "SHARD_TRACE_PLUGINS")


@pytest.fixture(autouse=True)
def clean_manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No switch is set unless a test sets one; the process-wide manager is rebuilt per test."""
    for switch in SWITCHES:
        monkeypatch.delenv(switch, raising=False)
    reset_plugin_manager()
    yield
    reset_plugin_manager()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(4, 4)  # 20 elements
        self.mlp = nn.Linear(4, 4)  # 20 elements


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)  # 32 elements
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 2)  # 10 elements


def test_both_plugins_are_found_through_their_entry_points() -> None:
    """The installed distributions register their plugin modules under their entry-point names."""
    pm = get_plugin_manager()
    assert isinstance(pm, ShardPluginManager)
    assert {"wrap-size", "wrap-transformer"} <= set(get_registry().plugin_names())
    assert pm.get_plugin("wrap-size") is shard_wrap_size.plugin
    assert pm.get_plugin("wrap-transformer") is shard_wrap_transformer.plugin
    assert pm.origin("wrap-size") == PluginOrigin(
        "wrap-size", "shard-wrap-size", shard_wrap_size.__version__
    )
    assert pm.origin("wrap-transformer") == PluginOrigin(
        "wrap-transformer", "shard-wrap-transformer", shard_wrap_transformer.__version__
    )


def test_policies_are_registered_by_name() -> None:
    """The real registry maps "size" and "transformer" to the plugins' policy classes."""
    policies = get_registry().wrap_policies()
    assert policies["size"] is SizeWrapPolicy
    assert policies["transformer"] is TransformerBlockPolicy


def test_size_policy_by_name_with_options_plans() -> None:
    """wrap_policy("size", min_num_params=40) makes each 40-element Block a unit."""
    policy = get_registry().wrap_policy("size", min_num_params=40)
    assert isinstance(policy, SizeWrapPolicy)
    plan = plan_wraps(Net(), policy)
    assert [(t.name, t.numel) for t in plan] == [("layers.0", 40), ("layers.1", 40), ("", 42)]


def test_transformer_policy_by_name_detects_blocks() -> None:
    """wrap_policy("transformer") with no options detects Block and makes each one a unit."""
    policy = get_registry().wrap_policy("transformer")
    assert isinstance(policy, TransformerBlockPolicy)
    plan = plan_wraps(Net(), policy)
    assert [(t.name, t.numel) for t in plan] == [("layers.0", 40), ("layers.1", 40), ("", 42)]


def test_transformer_policy_by_name_on_gpt2() -> None:
    """Through the real registry, a GPT-2 from a config gets one unit per GPT2Block."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=16, n_positions=8, n_embd=8, n_layer=3, n_head=2, bos_token_id=0, eos_token_id=0
    )
    plan = plan_wraps(
        transformers.GPT2LMHeadModel(config), get_registry().wrap_policy("transformer")
    )
    assert [t.name for t in plan] == ["transformer.h.0", "transformer.h.1", "transformer.h.2", ""]


def test_disabled_size_plugin_is_unknown_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """SHARD_DISABLE_PLUGINS=wrap-size removes "size", says why, and leaves "transformer"."""
    monkeypatch.setenv("SHARD_DISABLE_PLUGINS", "wrap-size")
    reg = get_registry()
    assert isinstance(reg.wrap_policy("transformer"), TransformerBlockPolicy)
    with pytest.raises(
        UnknownPluginNameError,
        match=r"^no wrap policy is registered as 'size'; registered: .*'transformer'.*\. 'size' "
        r"is provided by shard-wrap-size, which is installed but was not loaded \(blocked by "
        r"SHARD_DISABLE_PLUGINS\)$",
    ):
        reg.wrap_policy("size", min_num_params=1)


@pytest.mark.parametrize(
    ("name", "options", "problem", "accepted"),
    [
        (
            "size",
            {"bogus": 1},
            "got an unexpected keyword argument 'bogus'",
            "min_num_params=100000000, force_leaf_modules=None, exclude_wrap_modules=None",
        ),
        ("name_pattern", {}, "missing a required argument: 'pattern'", "pattern"),
    ],
)
def test_wrong_options_of_a_plugin_policy_name_its_options(
    name: str, options: dict[str, object], problem: str, accepted: str
) -> None:
    """A real plugin's factory with wrong options: the runtime's WrapPlanError, not a TypeError."""
    with pytest.raises(WrapPlanError) as info:
        get_registry().wrap_policy(name, **options)
    assert str(info.value) == (
        f"wrap policy {name!r} does not take the options {options!r}: {problem}; its options "
        f"are: {accepted}"
    )


def test_plugin_policy_raising_names_its_distribution_and_the_module() -> None:
    """An exception inside shard-wrap-example's wrap() names distribution, entry point, module."""
    policy = get_registry().wrap_policy("name_pattern", pattern=r"layers\.\d+")
    # Breaks its wrap() from the inside: the plugin's own line raises the TypeError.
    policy._regex = types.SimpleNamespace(pattern="layers", fullmatch=None)  # type: ignore[attr-defined]
    with pytest.raises(TypeError) as info:
        plan_wraps(Net(), policy)
    error = info.value
    assert isinstance(error, PluginCallError)
    assert str(error) == (
        "wrap policy NamePatternPolicy('layers') raised TypeError: 'NoneType' object is not "
        "callable in wrap() for module 'embed' (Embedding). It was raised in "
        f"shard-wrap-example {shard_wrap_example.__version__} (plugin 'wrap-example'), module "
        "'shard_wrap_example._policy': report it to the authors of shard-wrap-example with the "
        "traceback above, or block the plugin with SHARD_DISABLE_PLUGINS=wrap-example"
    )


class _AlsoSize:
    @hookimpl
    def shard_wrap_policies(self) -> Mapping[str, Any]:
        return {"size": SizeWrapPolicy, "also": SizeWrapPolicy}


def test_a_name_claimed_twice_disables_only_that_name() -> None:
    """A second plugin claiming "size" disables "size" only; every other name keeps working."""
    reg = get_registry()
    reg.plugin_manager.register(_AlsoSize(), name="also-size")
    size = f"shard-wrap-size {shard_wrap_size.__version__} (plugin 'wrap-size')"
    with pytest.warns(
        PluginWarning,
        match=rf"^wrap policy 'size' is registered by both {re.escape(size)} and plugin "
        r"'also-size', so neither is used; every other wrap policy works. Uninstall one of them, "
        r"or block one with SHARD_DISABLE_PLUGINS=wrap-size.$",
    ):
        policies = reg.wrap_policies()
    assert "size" not in policies
    assert {"also", "lambda", "module_class", "transformer"} <= set(policies)
    assert isinstance(reg.wrap_policy("transformer"), TransformerBlockPolicy)
    assert isinstance(reg.wrap_policy("also", min_num_params=1), SizeWrapPolicy)
    with pytest.raises(PluginCollisionError, match=r"so it is disabled: names must be unique"):
        reg.wrap_policy("size", min_num_params=1)
