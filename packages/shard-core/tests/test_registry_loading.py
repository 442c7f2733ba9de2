"""Loading third-party plugins from (faked) entry points: failures, switches, tracing, laziness."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from shard_core import (
    LambdaWrapPolicy,
    PluginWarning,
    get_plugin_manager,
    get_registry,
    hookimpl,
    make_plugin_manager,
    reset_plugin_manager,
)
from shard_core._version import __version__
from shard_core.plugin import PluginOrigin, Registry
from shard_core.plugin import _manager as manager_module
from shard_core.plugin._manager import ShardPluginManager


@dataclass(frozen=True)
class FakeDist:
    name: str
    version: str


@dataclass
class FakeEntryPoint:
    """An entry point of group shard whose load() returns ``plugin`` or calls ``loader``."""

    name: str
    dist: FakeDist | None
    plugin: object = None
    loader: Callable[[], object] | None = None
    loads: int = field(default=0)

    def load(self) -> object:
        self.loads += 1
        return self.loader() if self.loader is not None else self.plugin


class PolicyPlugin:
    def __init__(self, *names: str) -> None:
        self.names = names

    @hookimpl
    def shard_wrap_policies(self) -> Mapping[str, Any]:
        return dict.fromkeys(self.names, LambdaWrapPolicy)


def install(monkeypatch: pytest.MonkeyPatch, *entry_points: FakeEntryPoint) -> None:
    """Make ``entry_points`` the ones the loader finds."""
    monkeypatch.setattr(manager_module, "_entry_points", lambda: list(entry_points))


def names(pm: object) -> list[str]:
    assert isinstance(pm, ShardPluginManager)
    return Registry(pm).plugin_names()


def alpha_and_beta() -> tuple[FakeEntryPoint, FakeEntryPoint]:
    return (
        FakeEntryPoint("alpha", FakeDist("shard-alpha", "1.0"), PolicyPlugin("a")),
        FakeEntryPoint("beta", FakeDist("shard-beta", "2.0"), PolicyPlugin("b")),
    )


@pytest.fixture
def fresh_global() -> Iterator[None]:
    """The process-wide manager is rebuilt for the test and forgotten after it."""
    reset_plugin_manager()
    yield
    reset_plugin_manager()


@pytest.fixture
def trace_logger() -> Iterator[logging.Logger]:
    """The shard.plugin logger, restored after tracing changed its level."""
    logger = logging.getLogger("shard.plugin")
    level, handlers = logger.level, list(logger.handlers)
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers


# - loading


def test_entry_point_plugins_are_registered_under_their_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each entry point's object is registered under the entry-point name, with its origin."""
    install(monkeypatch, *alpha_and_beta())
    pm = make_plugin_manager(environ={})
    assert isinstance(pm, ShardPluginManager)
    assert names(pm) == ["alpha", "beta", "builtins"]
    assert pm.origin("beta") == PluginOrigin("beta", "shard-beta", "2.0")
    assert pm.origin("builtins") is None
    assert list(Registry(pm).wrap_policies()) == ["a", "b", "lambda", "module_class"]


def test_in_memory_manager_does_not_read_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    """make_plugin_manager(load_entry_points=False) registers the built-ins only."""
    alpha, beta = alpha_and_beta()
    install(monkeypatch, alpha, beta)
    assert names(make_plugin_manager(load_entry_points=False, environ={})) == ["builtins"]
    assert (alpha.loads, beta.loads) == (0, 0)


def test_plugin_failing_to_import_is_skipped_with_its_distribution(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An entry point that raises on load is a warning naming the distribution, not an error."""

    def broken() -> object:
        raise ImportError("No module named 'shard_broken_dep'")

    alpha, _ = alpha_and_beta()
    install(
        monkeypatch, alpha, FakeEntryPoint("broken", FakeDist("shard-broken", "0.3"), None, broken)
    )
    message = (
        "shard-broken 0.3 (plugin 'broken') failed to load: ImportError: No module named "
        "'shard_broken_dep'; it was skipped. Fix or uninstall shard-broken, or block it with "
        "SHARD_DISABLE_PLUGINS=broken to silence this warning."
    )
    with pytest.warns(PluginWarning, match=f"^{re.escape(message)}$"):
        pm = make_plugin_manager(environ={})
    assert isinstance(pm, ShardPluginManager)
    assert names(pm) == ["alpha", "builtins"]
    assert pm.not_loaded() == [
        (
            PluginOrigin("broken", "shard-broken", "0.3"),
            "failed to load: ImportError: No module named 'shard_broken_dep'",
        )
    ]


def test_plugin_without_a_distribution_is_named_by_entry_point(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An entry point that has no distribution is named by its entry-point name."""

    def broken() -> object:
        raise ValueError("bad config")

    install(monkeypatch, FakeEntryPoint("loose", None, None, broken))
    with pytest.warns(
        PluginWarning,
        match=r"^plugin 'loose' failed to load: ValueError: bad config; it was skipped. Fix or "
        r"uninstall the plugin, or block it with SHARD_DISABLE_PLUGINS=loose to silence this "
        r"warning.$",
    ):
        assert names(make_plugin_manager(environ={})) == ["builtins"]


def test_plugin_taking_a_builtin_name_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry point named like the built-in plugin cannot replace it."""
    install(monkeypatch, FakeEntryPoint("builtins", FakeDist("shard-evil", "1.0"), PolicyPlugin()))
    with pytest.warns(
        PluginWarning,
        match=r"^shard-evil 1.0 \(plugin 'builtins'\) could not be registered: ValueError: "
        r"Plugin name already registered: builtins",
    ):
        pm = make_plugin_manager(environ={})
    assert names(pm) == ["builtins"]
    assert list(Registry(pm).wrap_policies()) == ["lambda", "module_class"]


def test_plugin_with_a_bad_hook_signature_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hook implementation asking for arguments the spec does not have is skipped."""

    class BadSignature:
        @hookimpl
        def shard_device_handle(self, device_type: str, rank: int) -> None:
            return None

    install(monkeypatch, FakeEntryPoint("bad", FakeDist("shard-bad", "1.0"), BadSignature()))
    message = (
        "shard-bad 1.0 (plugin 'bad') implements shard_device_handle(device_type, rank), but "
        "shard calls shard_device_handle(device_type) and cannot pass rank; it was skipped. Fix "
        "or uninstall shard-bad, or block it with SHARD_DISABLE_PLUGINS=bad to silence this "
        "warning."
    )
    with pytest.warns(PluginWarning, match=f"^{re.escape(message)}$"):
        pm = make_plugin_manager(environ={})
    assert names(pm) == ["builtins"]
    assert isinstance(pm, ShardPluginManager)
    assert pm.not_loaded() == [
        (
            PluginOrigin("bad", "shard-bad", "1.0"),
            "implements shard_device_handle(device_type, rank), but shard calls "
            "shard_device_handle(device_type) and cannot pass rank",
        )
    ]
    assert pm.origin("bad") is None


def test_partly_bad_plugin_keeps_its_valid_hooks_and_lists_every_problem(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One bad hook (or two) skips those hooks only; the warning lists each problem."""

    class PartlyBad:
        @hookimpl
        def shard_wrap_policies(self) -> Mapping[str, Any]:
            return {"mine": LambdaWrapPolicy}

        @hookimpl
        def shard_wrap_policy(self) -> Mapping[str, Any]:  # misspelled
            return {}

        @hookimpl
        def shard_comm_hookz(self) -> Mapping[str, Any]:  # misspelled
            return {}

        @hookimpl
        def shard_device_handle(self, device_type: str, rank: int) -> None:
            return None

    install(monkeypatch, FakeEntryPoint("partly", FakeDist("shard-partly", "2.0"), PartlyBad()))
    message = (
        "shard-partly 2.0 (plugin 'partly') implements hooks shard does not define: "
        "shard_comm_hookz, shard_wrap_policy (known: shard_comm_codecs, shard_comm_hooks, "
        "shard_device_handle, "
        "shard_state_dict_backend, shard_wrap_policies); it also implements "
        "shard_device_handle(device_type, rank), but shard calls shard_device_handle(device_type) "
        "and cannot pass rank; those hooks were skipped, its other hooks are used "
        "(shard_wrap_policies). Fix or uninstall shard-partly, or block it with "
        "SHARD_DISABLE_PLUGINS=partly to silence this warning."
    )
    with pytest.warns(PluginWarning, match=f"^{re.escape(message)}$"):
        pm = make_plugin_manager(environ={})
    assert isinstance(pm, ShardPluginManager)
    assert names(pm) == ["builtins", "partly"]
    assert pm.origin("partly") == PluginOrigin("partly", "shard-partly", "2.0")
    assert pm.not_loaded() == []
    assert [c.name for c in pm.get_hookcallers(pm.get_plugin("partly")) or ()] == [
        "shard_wrap_policies"
    ]
    registry = Registry(pm)
    assert isinstance(registry.wrap_policy("mine", fn=bool), LambdaWrapPolicy)
    assert registry.device_handle("cpu").device_type == "cpu"


def test_in_memory_registration_is_checked_the_same_way() -> None:
    """pm.register() of a plugin with a misspelled hook warns too, naming the plugin."""

    class Typo:
        @hookimpl
        def shard_wrap_policy(self) -> dict[str, Any]:
            return {}

    pm = make_plugin_manager(load_entry_points=False)
    with pytest.warns(
        PluginWarning,
        match=r"^plugin 'typo' implements hooks shard does not define: shard_wrap_policy "
        r"\(known: .*\); it was skipped. Fix the plugin.$",
    ):
        assert pm.register(Typo(), name="typo") is None
    assert pm.get_plugin("typo") is None


def test_plugin_implementing_an_unknown_hook_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A misspelled hook name is reported with the hooks shard defines, and the plugin skipped."""

    class Typo:
        @hookimpl
        def shard_wrap_policy(self) -> dict[str, Any]:
            return {}

    install(monkeypatch, FakeEntryPoint("typo", FakeDist("shard-typo", "1.0"), Typo()))
    message = (
        "shard-typo 1.0 (plugin 'typo') implements hooks shard does not define: "
        "shard_wrap_policy (known: shard_comm_codecs, shard_comm_hooks, shard_device_handle, "
        "shard_state_dict_backend, shard_wrap_policies); "
        "it was skipped. Fix or uninstall shard-typo, or block it with "
        "SHARD_DISABLE_PLUGINS=typo to silence this warning."
    )
    with pytest.warns(PluginWarning, match=f"^{re.escape(message)}$"):
        assert names(make_plugin_manager(environ={})) == ["builtins"]


def test_optional_unknown_hook_is_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hook marked optionalhook (for a newer shard) does not get its plugin skipped."""

    class Newer:
        @hookimpl(optionalhook=True)
        def shard_future_hook(self) -> None:
            return None

    install(monkeypatch, FakeEntryPoint("newer", FakeDist("shard-newer", "1.0"), Newer()))
    assert names(make_plugin_manager(environ={})) == ["builtins", "newer"]


# - switches


@pytest.mark.parametrize(
    ("environ", "loaded"),
    [
        ({}, ["alpha", "beta", "builtins"]),
        ({"SHARD_DISABLE_PLUGINS": "1"}, ["builtins"]),
        ({"SHARD_DISABLE_PLUGINS": "ALL"}, ["builtins"]),
        ({"SHARD_DISABLE_PLUGINS": "0"}, ["alpha", "beta", "builtins"]),
        ({"SHARD_DISABLE_PLUGINS": ""}, ["alpha", "beta", "builtins"]),
        ({"SHARD_DISABLE_PLUGINS": "alpha"}, ["beta", "builtins"]),
        ({"SHARD_DISABLE_PLUGINS": " alpha , beta "}, ["builtins"]),
        ({"SHARD_DISABLE_PLUGINS": "Shard_Beta"}, ["alpha", "builtins"]),
        ({"SHARD_LOAD_PLUGINS": "beta"}, ["beta", "builtins"]),
        ({"SHARD_LOAD_PLUGINS": "shard-alpha"}, ["alpha", "builtins"]),
        ({"SHARD_LOAD_PLUGINS": ""}, ["builtins"]),
        (
            {"SHARD_LOAD_PLUGINS": "alpha,beta", "SHARD_DISABLE_PLUGINS": "beta"},
            ["alpha", "builtins"],
        ),
    ],
)
def test_switches_block_and_limit_third_party_plugins(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], loaded: list[str]
) -> None:
    """SHARD_DISABLE_PLUGINS and SHARD_LOAD_PLUGINS select by entry-point or distribution name."""
    install(monkeypatch, *alpha_and_beta())
    assert names(make_plugin_manager(environ=environ)) == loaded


def test_blocked_plugins_are_never_imported_and_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin kept out by a switch is not loaded at all, and the reason is kept."""
    alpha, beta = alpha_and_beta()
    install(monkeypatch, alpha, beta)
    pm = make_plugin_manager(
        environ={"SHARD_LOAD_PLUGINS": "alpha,beta", "SHARD_DISABLE_PLUGINS": "alpha"}
    )
    assert isinstance(pm, ShardPluginManager)
    assert (alpha.loads, beta.loads) == (0, 1)
    assert pm.not_loaded() == [
        (PluginOrigin("alpha", "shard-alpha", "1.0"), "blocked by SHARD_DISABLE_PLUGINS")
    ]
    pm = make_plugin_manager(environ={"SHARD_LOAD_PLUGINS": "beta"})
    assert isinstance(pm, ShardPluginManager)
    assert pm.not_loaded() == [
        (PluginOrigin("alpha", "shard-alpha", "1.0"), "not listed in SHARD_LOAD_PLUGINS")
    ]


_INSTALLED = "installed: shard-alpha 1.0 (plugin 'alpha'), shard-beta 2.0 (plugin 'beta')"


@pytest.mark.parametrize(
    ("switch", "value", "missing", "loaded"),
    [
        ("SHARD_LOAD_PLUGINS", "alpha,gamma", "gamma", ["alpha", "builtins"]),
        ("SHARD_DISABLE_PLUGINS", "alpah,beta", "alpah", ["alpha", "builtins"]),
    ],
)
def test_switch_naming_a_missing_plugin_warns(
    monkeypatch: pytest.MonkeyPatch, switch: str, value: str, missing: str, loaded: list[str]
) -> None:
    """A switch naming nothing installed (a typo) says so and lists what is installed."""
    install(monkeypatch, *alpha_and_beta())
    message = (
        f"{switch} names {missing!r}, but no installed shard plugin has that entry-point or "
        f"distribution name; {_INSTALLED}"
    )
    with pytest.warns(PluginWarning, match=f"^{re.escape(message)}$"):
        assert names(make_plugin_manager(environ={switch: value})) == loaded


def test_disable_switch_naming_the_builtins_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Built-ins are never blocked; asking to block them says so instead of doing nothing."""
    install(monkeypatch, *alpha_and_beta())
    message = "SHARD_DISABLE_PLUGINS names 'builtins': shard-core's built-ins are never blocked"
    with pytest.warns(PluginWarning, match=f"^{re.escape(message)}$"):
        loaded = names(make_plugin_manager(environ={"SHARD_DISABLE_PLUGINS": "builtins"}))
    assert loaded == ["alpha", "beta", "builtins"]


def test_trace_switch_logs_loading_and_hook_calls(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    trace_logger: logging.Logger,
) -> None:
    """SHARD_TRACE_PLUGINS=1 logs each plugin loaded or skipped and each hook answer."""
    install(monkeypatch, *alpha_and_beta())
    caplog.set_level(logging.DEBUG, logger="shard.plugin")
    pm = make_plugin_manager(environ={"SHARD_TRACE_PLUGINS": "1", "SHARD_DISABLE_PLUGINS": "beta"})
    Registry(pm).device_handle("cpu")
    assert [(r.name, r.levelno) for r in caplog.records] == [("shard.plugin", logging.DEBUG)] * 4
    assert caplog.messages == [
        f"registered shard-core {__version__} (built-in)",
        "loaded shard-alpha 1.0 (plugin 'alpha')",
        "did not load shard-beta 2.0 (plugin 'beta'): blocked by SHARD_DISABLE_PLUGINS",
        f"shard_device_handle(device_type='cpu'): shard-core {__version__} (built-in) "
        "answered CpuDeviceHandle()",
    ]


def test_trace_is_off_by_default(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Without the switch nothing is logged, even with the logger at DEBUG."""
    install(monkeypatch, *alpha_and_beta())
    caplog.set_level(logging.DEBUG, logger="shard.plugin")
    Registry(make_plugin_manager(environ={"SHARD_TRACE_PLUGINS": "0"})).wrap_policies()
    assert caplog.messages == []


def test_trace_switch_makes_the_logger_print_when_logging_is_not_set_up(
    monkeypatch: pytest.MonkeyPatch, trace_logger: logging.Logger
) -> None:
    """With no handler anywhere, tracing attaches a stderr handler at DEBUG to shard.plugin."""
    install(monkeypatch)
    trace_logger.setLevel(logging.NOTSET)
    monkeypatch.setattr(logging.Logger, "hasHandlers", lambda self: False)
    make_plugin_manager(environ={"SHARD_TRACE_PLUGINS": "yes"})
    added = trace_logger.handlers[-1]
    assert trace_logger.level == logging.DEBUG
    assert isinstance(added, logging.StreamHandler)
    assert added.formatter is not None
    assert added.formatter._fmt == "%(name)s: %(message)s"


# - the process-wide manager


@pytest.mark.usefixtures("fresh_global")
def test_global_manager_loads_entry_points_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Entry points are read on first use, once, and again only after a reset."""
    alpha, _ = alpha_and_beta()
    reads: list[int] = []
    monkeypatch.setattr(manager_module, "_entry_points", lambda: reads.append(1) or [alpha])
    assert reads == []
    pm = get_plugin_manager()
    assert get_plugin_manager() is pm
    assert get_registry() is get_registry()
    assert get_registry().plugin_manager is pm
    assert (len(reads), alpha.loads) == (1, 1)
    reset_plugin_manager()
    assert get_plugin_manager() is not pm
    assert get_registry().plugin_manager is get_plugin_manager()
    assert len(reads) == 2


@pytest.mark.usefixtures("fresh_global")
def test_global_manager_reads_switches_when_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """The switches in the environment at build time apply; a reset reads them again."""
    install(monkeypatch, *alpha_and_beta())
    monkeypatch.setenv("SHARD_DISABLE_PLUGINS", "all")
    assert get_registry().plugin_names() == ["builtins"]
    monkeypatch.setenv("SHARD_DISABLE_PLUGINS", "beta")
    assert get_registry().plugin_names() == ["builtins"]
    reset_plugin_manager()
    assert get_registry().plugin_names() == ["alpha", "builtins"]


@pytest.mark.usefixtures("fresh_global")
def test_global_manager_is_built_once_across_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads asking at the same time get one manager and one registry; plugins load once."""

    def slow() -> object:
        time.sleep(0.05)
        return PolicyPlugin("slow")

    slow_ep = FakeEntryPoint("slow", FakeDist("shard-slow", "1.0"), None, slow)
    install(monkeypatch, slow_ep)
    results: list[Registry] = []
    start = threading.Barrier(8)

    def ask() -> None:
        start.wait()
        results.append(get_registry())

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 8
    assert all(reg is results[0] for reg in results)
    assert slow_ep.loads == 1


@pytest.mark.usefixtures("fresh_global")
def test_plugin_using_the_registry_at_import_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin that asks for the manager while it is being loaded is reported, not deadlocked."""
    eager = FakeEntryPoint("eager", FakeDist("shard-eager", "1.0"), None, get_plugin_manager)
    install(monkeypatch, eager)
    with pytest.warns(
        PluginWarning,
        match=r"^shard-eager 1.0 \(plugin 'eager'\) failed to load: PluginError: "
        r"get_plugin_manager\(\) was called while shard's plugins are being loaded",
    ):
        assert get_registry().plugin_names() == ["builtins"]
