"""shard-wrap-example found through its real entry point by the real, process-wide registry."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from torch import nn

import shard_wrap_example
import shard_wrap_example.plugin
from shard_core import get_plugin_manager, get_registry, plan_wraps, reset_plugin_manager
from shard_core.errors import UnknownPluginNameError
from shard_core.plugin import PluginOrigin
from shard_core.plugin._manager import ShardPluginManager
from shard_wrap_example import NamePatternPolicy

SWITCHES = ("SHARD_DISABLE_PLUGINS", "SHARD_LOAD_PLUGINS", "SHARD_TRACE_PLUGINS")
EXAMPLE = f"shard-wrap-example {shard_wrap_example.__version__} (plugin 'wrap-example')"


@pytest.fixture(autouse=True)
def clean_manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No switch is set unless a test sets one; the process-wide manager is rebuilt per test."""
    for switch in SWITCHES:
        monkeypatch.delenv(switch, raising=False)
    reset_plugin_manager()
    yield
    reset_plugin_manager()


@pytest.fixture
def trace_logger() -> Iterator[logging.Logger]:
    """The shard.plugin logger, restored after tracing changed it."""
    logger = logging.getLogger("shard.plugin")
    level, handlers = logger.level, list(logger.handlers)
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
        self.head = nn.Linear(2, 1)


def test_example_plugin_is_found_through_its_entry_point() -> None:
    """The installed distribution's entry point registers its module under 'wrap-example'."""
    pm = get_plugin_manager()
    assert isinstance(pm, ShardPluginManager)
    assert "wrap-example" in get_registry().plugin_names()
    assert pm.get_plugin("wrap-example") is shard_wrap_example.plugin
    assert pm.origin("wrap-example") == PluginOrigin(
        "wrap-example", "shard-wrap-example", shard_wrap_example.__version__
    )


def test_name_pattern_policy_works_through_the_real_registry() -> None:
    """wrap_policy('name_pattern', pattern=...) builds the plugin's policy, and it plans."""
    policy = get_registry().wrap_policy("name_pattern", pattern=r"layers\.\d+")
    assert isinstance(policy, NamePatternPolicy)
    plan = plan_wraps(Net(), policy)
    assert [(t.name, t.numel) for t in plan] == [("layers.0", 6), ("layers.1", 6), ("", 3)]


@pytest.mark.parametrize("blocked", ["wrap-example", "shard-wrap-example", "1", "all"])
def test_disable_switch_keeps_the_example_out(
    monkeypatch: pytest.MonkeyPatch, blocked: str
) -> None:
    """SHARD_DISABLE_PLUGINS by entry-point name, distribution name or 'all' excludes it."""
    monkeypatch.setenv("SHARD_DISABLE_PLUGINS", blocked)
    reg = get_registry()
    assert "wrap-example" not in reg.plugin_names()
    assert "builtins" in reg.plugin_names()
    with pytest.raises(
        UnknownPluginNameError,
        match=r"^no wrap policy is registered as 'name_pattern'; registered: 'lambda', "
        r"'module_class'",
    ):
        reg.wrap_policy("name_pattern", pattern="x")


def test_load_switch_loads_only_the_listed_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    """SHARD_LOAD_PLUGINS=wrap-example loads the example and no other third-party plugin."""
    monkeypatch.setenv("SHARD_LOAD_PLUGINS", "wrap-example")
    reg = get_registry()
    assert reg.plugin_names() == ["builtins", "wrap-example"]
    assert isinstance(reg.wrap_policy("name_pattern", pattern="head"), NamePatternPolicy)


def test_blocked_device_plugin_is_named_in_the_device_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the CUDA plugin blocked, resolving 'cuda' says it is installed but blocked."""
    monkeypatch.setenv("SHARD_DISABLE_PLUGINS", "cuda")
    with pytest.raises(
        UnknownPluginNameError,
        match=r"^no shard plugin serves device type 'cuda': shard-device-cuda is installed but "
        r"was not loaded \(blocked by SHARD_DISABLE_PLUGINS\)$",
    ):
        get_registry().device_handle("cuda")


def test_trace_switch_logs_the_example_loading_and_answering(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    trace_logger: logging.Logger,
) -> None:
    """SHARD_TRACE_PLUGINS=1 logs the plugin with its distribution and its hook answer."""
    monkeypatch.setenv("SHARD_TRACE_PLUGINS", "1")
    monkeypatch.setenv("SHARD_LOAD_PLUGINS", "wrap-example")
    caplog.set_level(logging.DEBUG, logger="shard.plugin")
    get_registry().wrap_policies()
    assert f"loaded {EXAMPLE}" in caplog.messages
    assert (
        f"shard_wrap_policies(): {EXAMPLE} answered {{'name_pattern': {NamePatternPolicy!r}}}"
        in caplog.messages
    )


def test_importing_shard_core_loads_no_plugin() -> None:
    """Entry points load on first use of the registry, never on import of shard_core."""
    script = (
        "import sys, shard_core\n"
        "print('shard_wrap_example.plugin' in sys.modules)\n"
        "shard_core.get_registry()\n"
        "print('shard_wrap_example.plugin' in sys.modules)\n"
    )
    env_free = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env=env_free,
        timeout=120,
    )
    assert done.stdout.split() == ["False", "True"]
