"""Distribution info of entry-point plugins, recorded where pluggy-based tools read it."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pluggy
import pytest

from shard_core import (
    LambdaWrapPolicy,
    PluginWarning,
    get_plugin_manager,
    hookimpl,
    make_plugin_manager,
    reset_plugin_manager,
)
from shard_core.plugin import _manager as manager_module


class InMemoryDistribution(importlib.metadata.Distribution):
    """A real ``importlib.metadata.Distribution`` whose METADATA lives in memory."""

    def __init__(self, name: str, version: str) -> None:
        self._metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"

    def read_text(self, filename: str) -> str | None:
        return self._metadata if filename == "METADATA" else None

    def locate_file(self, path: str | Any) -> Path:
        return Path(str(path))


@dataclass
class FakeEntryPoint:
    """An entry point of group shard whose load() returns ``plugin`` or calls ``loader``."""

    name: str
    dist: importlib.metadata.Distribution | None
    plugin: object = None
    loader: Callable[[], object] | None = None

    def load(self) -> object:
        return self.loader() if self.loader is not None else self.plugin


class PolicyPlugin:
    def __init__(self, *names: str) -> None:
        self.names = names

    @hookimpl
    def shard_wrap_policies(self) -> Mapping[str, Any]:
        return dict.fromkeys(self.names, LambdaWrapPolicy)


class UnknownHookPlugin:
    @hookimpl
    def shard_wrap_policy(self) -> None:
        return None


def install(monkeypatch: pytest.MonkeyPatch, *entry_points: FakeEntryPoint) -> None:
    """Make ``entry_points`` the ones the loader finds."""
    monkeypatch.setattr(manager_module, "_entry_points", lambda: list(entry_points))


def header(pm: pluggy.PluginManager) -> list[str]:
    """The "plugins:" entries a pytest-style tool prints from the manager."""
    return [f"{dist.project_name}-{dist.version}" for _, dist in pm.list_plugin_distinfo()]


@pytest.fixture
def fresh_global() -> Iterator[None]:
    """The process-wide manager is rebuilt for the test and forgotten after it."""
    reset_plugin_manager()
    yield
    reset_plugin_manager()


def test_loaded_plugins_are_listed_with_their_distributions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """list_plugin_distinfo() pairs each loaded plugin with its distribution, in load order."""
    alpha, beta = PolicyPlugin("a"), PolicyPlugin("b")
    alpha_dist = InMemoryDistribution("shard-alpha", "1.0")
    beta_dist = InMemoryDistribution("shard_Beta", "2.0rc1")
    install(
        monkeypatch,
        FakeEntryPoint("beta", beta_dist, beta),
        FakeEntryPoint("alpha", alpha_dist, alpha),
    )
    pm = make_plugin_manager(environ={})
    assert header(pm) == ["shard-alpha-1.0", "shard_Beta-2.0rc1"]
    assert [plugin for plugin, _ in pm.list_plugin_distinfo()] == [alpha, beta]
    assert pm.list_plugin_distributions() == [(alpha, alpha_dist), (beta, beta_dist)]


def test_distinfo_is_pluggys_wrapper_around_the_distribution(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Entries are pluggy's DistFacade, as its own loader gives: metadata and .project_name."""
    dist = InMemoryDistribution("shard-alpha", "1.0")
    install(monkeypatch, FakeEntryPoint("alpha", dist, PolicyPlugin("a")))
    ours = make_plugin_manager(environ={}).list_plugin_distinfo()
    reference = pluggy.PluginManager("reference")
    reference._plugin_distinfo.append((object(), dist))  # what pluggy's loader stores
    ((_, facade),) = ours
    ((_, pluggy_facade),) = reference.list_plugin_distinfo()
    assert type(facade) is type(pluggy_facade)
    assert (facade.project_name, facade.version) == ("shard-alpha", "1.0")
    assert facade.metadata["Name"] == "shard-alpha"


def test_plugins_not_loaded_from_a_distribution_are_not_listed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Built-ins, in-memory plugins and an entry point without a distribution have no distinfo."""
    loose = PolicyPlugin("loose")
    install(monkeypatch, FakeEntryPoint("loose", None, loose))
    pm = make_plugin_manager(environ={})
    assert pm.get_plugin("loose") is loose
    pm.register(PolicyPlugin("memory"), name="memory")
    assert pm.list_plugin_distinfo() == []
    assert make_plugin_manager(load_entry_points=False, environ={}).list_plugin_distinfo() == []


def test_blocked_and_limited_plugins_are_not_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plugins kept out by SHARD_DISABLE_PLUGINS or SHARD_LOAD_PLUGINS have no distinfo."""
    install(
        monkeypatch,
        FakeEntryPoint("alpha", InMemoryDistribution("shard-alpha", "1.0"), PolicyPlugin("a")),
        FakeEntryPoint("beta", InMemoryDistribution("shard-beta", "2.0"), PolicyPlugin("b")),
        FakeEntryPoint("gamma", InMemoryDistribution("shard-gamma", "3.0"), PolicyPlugin("c")),
    )
    limited = make_plugin_manager(
        environ={"SHARD_DISABLE_PLUGINS": "shard-beta", "SHARD_LOAD_PLUGINS": "beta,gamma"}
    )
    assert header(limited) == ["shard-gamma-3.0"]
    assert header(make_plugin_manager(environ={"SHARD_DISABLE_PLUGINS": "all"})) == []


def test_plugins_that_fail_are_not_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin failing to import, to register, or implementing unknown hooks has no distinfo."""

    def broken() -> object:
        raise ImportError("No module named 'shard_broken_dep'")

    install(
        monkeypatch,
        FakeEntryPoint("alpha", InMemoryDistribution("shard-alpha", "1.0"), PolicyPlugin("a")),
        FakeEntryPoint("broken", InMemoryDistribution("shard-broken", "0.3"), None, broken),
        FakeEntryPoint("builtins", InMemoryDistribution("shard-evil", "1.0"), PolicyPlugin()),
        FakeEntryPoint("typo", InMemoryDistribution("shard-typo", "0.1"), UnknownHookPlugin()),
    )
    with pytest.warns(PluginWarning) as caught:
        pm = make_plugin_manager(environ={})
    assert len(caught) == 3
    assert header(pm) == ["shard-alpha-1.0"]


@pytest.mark.usefixtures("fresh_global")
def test_global_manager_lists_distinfo(monkeypatch: pytest.MonkeyPatch) -> None:
    """shard_core.get_plugin_manager().list_plugin_distinfo() names the loaded distributions."""
    install(
        monkeypatch,
        FakeEntryPoint("alpha", InMemoryDistribution("shard-alpha", "1.0"), PolicyPlugin("a")),
    )
    assert header(get_plugin_manager()) == ["shard-alpha-1.0"]
    assert header(get_plugin_manager()) == ["shard-alpha-1.0"]
