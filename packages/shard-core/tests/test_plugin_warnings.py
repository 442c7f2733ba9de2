"""Where a PluginWarning shows: at the caller's line, once per process, on local rank 0 only.

See [Note: where plugin warnings show] in ``shard_core/plugin/_report.py``.
"""

from __future__ import annotations

import logging
import sys
import textwrap
import types
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch.distributed as dist

from shard_core import PluginWarning, Registry, hookimpl, make_plugin_manager
from shard_core.plugin import _manager as manager_module
from shard_core.plugin import get_registry, reset_plugin_manager


class Raising:
    @hookimpl
    def shard_wrap_policies(self) -> object:
        raise RuntimeError("boom")


@dataclass(frozen=True)
class FakeDist:
    name: str
    version: str


@dataclass(frozen=True)
class BrokenEntryPoint:
    name: str
    dist: FakeDist | None
    module: str = "shard_broken.plugin"

    def load(self) -> object:
        raise ImportError("No module named 'shard_broken_dep'")


def raising_registry(environ: dict[str, str] | None = None) -> Registry:
    pm = make_plugin_manager(load_entry_points=False, environ=environ)
    pm.register(Raising(), name="bad")
    return Registry(pm)


def next_line() -> int:
    """The line number after the caller's."""
    return sys._getframe(1).f_lineno + 1


@pytest.fixture
def fresh_global() -> Iterator[None]:
    reset_plugin_manager()
    yield
    reset_plugin_manager()


@pytest.fixture
def no_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """No launcher's rank in the environment: this process shows warnings."""
    for variable in ("LOCAL_RANK", "RANK"):
        monkeypatch.delenv(variable, raising=False)


# - location


@pytest.mark.usefixtures("no_rank")
def test_registry_warning_points_at_the_callers_line() -> None:
    """The warning's file and line are the test's call, not shard's _registry.py."""
    reg = raising_registry()
    line = next_line() + 1  # the call inside the block
    with pytest.warns(PluginWarning) as warned:
        reg.wrap_policies()
    assert [(w.filename, w.lineno) for w in warned] == [(__file__, line)]


@pytest.mark.usefixtures("no_rank")
def test_warning_skips_every_frame_of_shards_packages() -> None:
    """A lookup made inside another shard package (a layer, a plugin) still points at the user."""
    layer = types.ModuleType("shard_fakelayer.api")
    source = """
    def build(registry):
        return registry.wrap_policies()
    """
    exec(compile(textwrap.dedent(source), "<shard_fakelayer.api>", "exec"), layer.__dict__)
    reg = raising_registry()
    line = next_line() + 1  # the call inside the block
    with pytest.warns(PluginWarning) as warned:
        layer.build(reg)
    assert [(w.filename, w.lineno) for w in warned] == [(__file__, line)]


@pytest.mark.usefixtures("no_rank")
def test_loading_warning_points_at_the_first_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin failing to import is reported at the line that first used the registry."""
    broken = BrokenEntryPoint("broken", FakeDist("shard-broken", "0.3"))
    monkeypatch.setattr(manager_module, "_entry_points", lambda: [broken])
    line = next_line() + 1  # the call inside the block
    with pytest.warns(PluginWarning, match=r"^shard-broken 0.3 \(plugin 'broken'\)") as warned:
        make_plugin_manager(environ={})
    assert [(w.filename, w.lineno) for w in warned] == [(__file__, line)]


# - once per process


@pytest.mark.usefixtures("fresh_global", "no_rank")
def test_process_wide_manager_shows_a_warning_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lookups from many call sites, after the plugins changed, still show one warning."""
    monkeypatch.setattr(manager_module, "_entry_points", lambda: [])
    registry = get_registry()
    registry.plugin_manager.register(Raising(), name="bad")
    with pytest.warns(PluginWarning) as warned:
        registry.wrap_policies()
    assert len(warned) == 1
    registry.plugin_manager.register(Raising(), name="bad-too")
    with pytest.warns(PluginWarning, match="plugin 'bad-too'") as again:
        get_registry().wrap_policies()  # only the new plugin's warning is new
    assert len(again) == 1
    get_registry().comm_hooks()
    get_registry().wrap_policies()


# - once per host


@pytest.mark.parametrize(
    ("environ", "shown"),
    [
        ({}, True),
        ({"LOCAL_RANK": "0", "RANK": "4"}, True),  # local rank 0 of the second host
        ({"LOCAL_RANK": "1", "RANK": "1"}, False),
        ({"LOCAL_RANK": "3", "RANK": "0"}, False),  # LOCAL_RANK decides when both are set
        ({"RANK": "0"}, True),
        ({"RANK": "2"}, False),
        ({"LOCAL_RANK": "not a rank"}, True),
    ],
)
def test_only_local_rank_zero_shows_warnings(
    environ: dict[str, str], shown: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """torchrun's LOCAL_RANK (else RANK) picks the one process per host that shows warnings."""
    caplog.set_level(logging.DEBUG, logger="shard.plugin")
    reg = raising_registry(environ)
    if shown:
        with pytest.warns(PluginWarning, match=r"^plugin 'bad' raised RuntimeError: boom"):
            reg.wrap_policies()
        assert caplog.messages == []
    else:
        reg.wrap_policies()  # a warning would be an error here
        assert caplog.messages == [
            "PluginWarning (shown by local rank 0): plugin 'bad' raised RuntimeError: boom in "
            "shard_wrap_policies(); its answer was skipped. Report this to the plugin's authors."
        ]


@pytest.mark.parametrize(("rank", "shown"), [(0, True), (1, False)])
def test_rank_of_an_initialised_process_group_decides_without_launcher_variables(
    monkeypatch: pytest.MonkeyPatch, rank: int, shown: bool
) -> None:
    """Without LOCAL_RANK and RANK (mp.spawn), the default group's rank decides."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda *args: rank)
    reg = raising_registry({})
    if shown:
        with pytest.warns(PluginWarning):
            reg.wrap_policies()
    else:
        reg.wrap_policies()  # a warning would be an error here


@pytest.mark.usefixtures("fresh_global")
def test_process_wide_manager_reads_the_rank_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under torchrun on local rank 1, a plugin failing to load is logged, not shown."""
    broken = BrokenEntryPoint("broken", FakeDist("shard-broken", "0.3"))
    monkeypatch.setattr(manager_module, "_entry_points", lambda: [broken])
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("SHARD_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("SHARD_LOAD_PLUGINS", raising=False)
    assert get_registry().plugin_names() == ["builtins"]
