"""Building shard's plugin manager: hook specifications, built-ins, then third-party plugins.

Loading an entry point is where third-party code first runs inside shard, so
this is where its failures are contained: a plugin that cannot be imported or
registered becomes a :class:`PluginWarning` naming its distribution, never an
error of the user's program. The environment switches that block, limit and
trace plugins are read here too, once per manager.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import pluggy

from shard_core._version import __version__
from shard_core.errors import PluginWarning
from shard_core.plugin import _builtins, _report, hookspecs
from shard_core.plugin.hookspecs import PROJECT_NAME

__all__ = [
    "BUILTINS_NAME",
    "ENV_DISABLE",
    "ENV_LOAD",
    "ENV_TRACE",
    "PluginOrigin",
    "PluginWarning",
    "ShardPluginManager",
    "describe_plugin",
    "is_builtin",
    "logger",
    "make_plugin_manager",
]

ENV_DISABLE = "SHARD_DISABLE_PLUGINS"
ENV_LOAD = "SHARD_LOAD_PLUGINS"
ENV_TRACE = "SHARD_TRACE_PLUGINS"

BUILTINS_NAME = "builtins"
"""The name shard-core's own plugin is registered under."""

logger = _report.logger

# [Note: plugin switches]
# SHARD_DISABLE_PLUGINS: "1" or "all" blocks every third-party plugin; a comma
# list blocks those entry-point (or distribution) names. "" and "0" block none.
# SHARD_LOAD_PLUGINS: when set, only the listed third-party plugins load; set
# to "" it loads none (as LLM_LOAD_PLUGINS does). A name in both lists is
# blocked. Built-ins are never blocked or limited. A name in either list that
# matches no installed plugin warns (a typo would otherwise change nothing).
# SHARD_TRACE_PLUGINS: "1" (or true/yes/on) logs every plugin loaded or
# skipped and every hook call with its result, at DEBUG level on the
# "shard.plugin" logger (which then prints to stderr unless logging is set up).

# [Note: distribution info]
# Tools built on pluggy ask the manager which distributions its plugins came
# from: pytest-style "plugins: name-version" headers, bug-report helpers.
# pluggy's own entry-point loader (load_setuptools_entrypoints) answers that by
# appending (plugin, the entry point's importlib.metadata distribution) to the
# manager's _plugin_distinfo list for every plugin it registers;
# list_plugin_distinfo() hands the pairs out wrapped in pluggy's DistFacade
# (which adds pkg_resources' .project_name), list_plugin_distributions() raw.
# We load entry points ourselves (for the switches, and to contain failures),
# so we append the same raw pair to the same list for every plugin that ends up
# registered: never for a blocked or failed one, a built-in, a plugin
# registered in memory, or an entry point without a distribution (pluggy's
# loader never meets one). That is pluggy 1.7's layout (1.5 and 1.6 stored the
# DistFacade itself); tests/test_plugin_distinfo.py fails if pluggy changes it.


@dataclass(frozen=True, slots=True)
class PluginOrigin:
    """Where a third-party plugin comes from.

    Attributes:
        entry_point: Its entry-point name in group ``shard`` (also its plugin name).
        distribution: The installed distribution that declares it, or ``None``
            when the entry point has none.
        version: That distribution's version, or ``None``.
    """

    entry_point: str
    distribution: str | None
    version: str | None

    def describe(self) -> str:
        """How messages name it: ``"shard-wrap-example 0.1.0 (plugin 'wrap-example')"``.

        Without a distribution: ``"plugin 'wrap-example'"``.
        """
        if self.distribution is None:
            return f"plugin {self.entry_point!r}"
        return f"{self.distribution} {self.version} (plugin {self.entry_point!r})"


class ShardPluginManager(pluggy.PluginManager):
    """A pluggy manager that remembers where each third-party plugin came from.

    The registry uses that to name distributions in warnings and errors, and
    to say why a plugin it would need was not loaded. It also checks each
    hook implementation as a plugin registers (see [Note: one bad hook]) and
    shows each :class:`PluginWarning` once (see :meth:`warn`).
    """

    def __init__(
        self, *, trace_calls: bool = False, environ: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(PROJECT_NAME)
        self.trace_calls = trace_calls
        self._environ: Mapping[str, str] = os.environ if environ is None else environ
        self._origins: dict[str, PluginOrigin] = {}
        self._not_loaded: list[tuple[PluginOrigin, str]] = []
        self._warned: set[str] = set()
        # (hook, problem; None: a hook shard does not define), while a plugin registers
        self._rejected: list[tuple[str, str | None]] | None = None
        self._rejection: dict[str, str] = {}  # plugin name -> why none of its hooks was kept

    def origin(self, name: str) -> PluginOrigin | None:
        """Where the plugin registered as ``name`` came from (``None``: not an entry point)."""
        return self._origins.get(name)

    def not_loaded(self) -> list[tuple[PluginOrigin, str]]:
        """Entry points that were found but not registered, each with the reason."""
        return list(self._not_loaded)

    def note_loaded(self, origin: PluginOrigin) -> None:
        """Record that the plugin registered as ``origin.entry_point`` came from ``origin``."""
        self._origins[origin.entry_point] = origin

    def note_distribution(self, plugin: object, dist: importlib.metadata.Distribution) -> None:
        """Record the distribution a registered entry-point plugin came from, as pluggy does.

        See [Note: distribution info].
        """
        self._plugin_distinfo.append((plugin, dist))

    def note_not_loaded(self, origin: PluginOrigin, reason: str) -> None:
        """Record an entry point that was found but not registered, and why."""
        self._not_loaded.append((origin, reason))

    def warn(self, message: str) -> None:
        """Show ``message`` as a :class:`PluginWarning`, unless this manager showed it already.

        See [Note: where plugin warnings show] in ``_report.py``: once per
        process (the process has one manager), on local rank 0 of each host,
        at the first caller outside shard.
        """
        if message in self._warned:
            return
        self._warned.add(message)
        _report.emit(message, self._environ)

    # - registering, one hook at a time (see [Note: one bad hook])

    def register(
        self, plugin: object, name: str | None = None, *, origin: PluginOrigin | None = None
    ) -> str | None:
        """Register ``plugin`` with its valid hooks; skip, and report, each invalid one.

        ``origin`` (an entry point's) is recorded when the plugin is kept.
        Returns the plugin's name, or ``None`` when no hook of it was valid
        (then it is not registered, and :meth:`rejection` says why).

        Raises:
            ValueError: the name or the plugin is registered already (pluggy).
            pluggy.PluginValidationError: a hook pluggy refuses for another
                reason (a hook wrapper that is not a generator...).
        """
        self._rejected = []
        try:
            registered = super().register(plugin, name)
        finally:
            rejected, self._rejected = self._rejected, None
        if registered is None:
            return None
        if origin is not None:
            self.note_loaded(origin)
        if not rejected:
            return registered
        problems = _problems(rejected)
        who = describe_plugin(self, registered)
        kept = sorted({caller.name for caller in self.get_hookcallers(plugin) or ()})
        if kept:
            skipped = sorted({hook for hook, _ in rejected})
            these = f"the hook {skipped[0]} was" if len(skipped) == 1 else "those hooks were"
            self.warn(
                f"{who} {problems}; {these} skipped, its other hooks are used "
                f"({', '.join(kept)}). {_fix(self.origin(registered))}"
            )
            return registered
        self.unregister(plugin)
        self._origins.pop(registered, None)
        self._rejection[registered] = problems
        self.warn(f"{who} {problems}; it was skipped. {_fix(origin)}")
        return None

    def rejection(self, name: str) -> str | None:
        """Why the plugin offered as ``name`` was not registered (none of its hooks was valid)."""
        return self._rejection.get(name)

    def parse_hookimpl_opts(self, plugin: object, name: str) -> pluggy.HookimplOpts | None:
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None or self._rejected is None:
            return opts
        hook_name = opts.get("specname") or name
        caller: pluggy.HookCaller | None = getattr(self.hook, hook_name, None)
        if caller is None or caller.spec is None:
            if opts.get("optionalhook"):
                return opts
            self._rejected.append((hook_name, None))
            return None
        problem = _signature_problem(caller, getattr(plugin, name, None))
        if problem is not None:
            self._rejected.append((hook_name, problem))
            return None
        return opts


# [Note: one bad hook]
# pluggy refuses a whole plugin when one of its hooks is invalid, which would
# throw away its valid hooks too. So the manager checks each implementation
# as pluggy parses it, skips only the bad ones and lists every problem in one
# warning: a hook shard does not define (unless marked optionalhook, for a
# newer shard), and a hook asking for arguments its specification does not
# pass. A plugin none of whose hooks is valid is not registered at all.


def _signature_problem(caller: pluggy.HookCaller, function: object) -> str | None:
    """What is wrong with ``function``'s arguments as an implementation of ``caller``'s hook."""
    spec = caller.spec
    assert spec is not None
    try:
        parameters = inspect.signature(function).parameters.values()  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None  # pluggy decides
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p.name for p in parameters if p.kind in positional and p.default is p.empty]
    passed = (*spec.argnames, *spec.kwargnames)
    extra = [n for n in required if n not in passed]
    if not extra:
        return None
    return (
        f"implements {spec.name}({', '.join(required)}), but shard calls "
        f"{spec.name}({', '.join(passed)}) and cannot pass {', '.join(extra)}"
    )


def _problems(rejected: list[tuple[str, str | None]]) -> str:
    """One plugin's problems as one clause: ``implements ...; it also implements ...``."""
    unknown = sorted(hook for hook, problem in rejected if problem is None)
    clauses = [problem for _, problem in rejected if problem is not None]
    if unknown:
        known = ", ".join(sorted(n for n in hookspecs.__all__ if n.startswith("shard_")))
        clauses.insert(
            0, f"implements hooks shard does not define: {', '.join(unknown)} (known: {known})"
        )
    return "; it also ".join(clauses)


def is_builtin(pm: pluggy.PluginManager, name: str) -> bool:
    """Whether the plugin registered as ``name`` is shard-core's own."""
    return pm.get_plugin(name) is _builtins


def describe_plugin(pm: pluggy.PluginManager, name: str) -> str:
    """How messages name the plugin registered as ``name``: its distribution when it has one."""
    if is_builtin(pm, name):
        return f"shard-core {__version__} (built-in)"
    origin = pm.origin(name) if isinstance(pm, ShardPluginManager) else None
    return origin.describe() if origin is not None else f"plugin {name!r}"


def make_plugin_manager(
    *, load_entry_points: bool = True, environ: Mapping[str, str] | None = None
) -> pluggy.PluginManager:
    """Build a new plugin manager: hook specifications, the built-ins, then entry points.

    ``load_entry_points=False`` gives the in-memory manager unit tests
    register their plugins on (``pm.register(obj, name=...)``).
    ``environ`` (default ``os.environ``) supplies the switches described in
    the package README; they are read now, once.
    """
    env = os.environ if environ is None else environ
    trace = env.get(ENV_TRACE, "").strip().lower() in {"1", "true", "yes", "on"}
    if trace:
        _enable_trace_output()
    pm = ShardPluginManager(trace_calls=trace, environ=env)
    pm.add_hookspecs(hookspecs)
    pm.register(_builtins, name=BUILTINS_NAME)
    if trace:
        logger.debug("registered %s", describe_plugin(pm, BUILTINS_NAME))
    if load_entry_points:
        _load_entry_points(pm, env)
    return pm


# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------


class _EntryPoint(Protocol):
    """What the loader uses of an ``importlib.metadata.EntryPoint``."""

    @property
    def name(self) -> str: ...

    @property
    def dist(self) -> importlib.metadata.Distribution | None: ...

    @property
    def module(self) -> str: ...

    def load(self) -> Any: ...


def _entry_points() -> Iterable[_EntryPoint]:
    """The entry points of group ``shard`` in this environment (a seam for tests)."""
    return importlib.metadata.entry_points(group=PROJECT_NAME)


def _normalize(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


@dataclass(frozen=True, slots=True)
class _Selection:
    """Which third-party plugins the environment lets load. See [Note: plugin switches]."""

    block_all: bool
    blocked: frozenset[str]
    only: frozenset[str] | None

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> _Selection:
        disable = env.get(ENV_DISABLE, "").strip()
        block_all = disable.lower() in {"1", "all"}
        blocked = frozenset() if block_all or disable == "0" else _names(disable)
        load = env.get(ENV_LOAD)
        return cls(block_all, blocked, None if load is None else _names(load))

    def reason_to_skip(self, origin: PluginOrigin) -> str | None:
        if self.block_all:
            return f"{ENV_DISABLE} blocks all plugins"
        if any(_matches(name, origin) for name in self.blocked):
            return f"blocked by {ENV_DISABLE}"
        if self.only is not None and not any(_matches(name, origin) for name in self.only):
            return f"not listed in {ENV_LOAD}"
        return None


def _names(value: str) -> frozenset[str]:
    return frozenset(part.strip() for part in value.split(",")) - {""}


def _matches(name: str, origin: PluginOrigin) -> bool:
    """Whether a name from a switch means this plugin: its entry-point or distribution name."""
    if name == origin.entry_point:
        return True
    return origin.distribution is not None and _normalize(name) == _normalize(origin.distribution)


def _origin_of(entry_point: _EntryPoint) -> PluginOrigin:
    dist = entry_point.dist
    if dist is None:
        return PluginOrigin(entry_point.name, None, None)
    return PluginOrigin(entry_point.name, dist.name, dist.version)


def _load_entry_points(pm: ShardPluginManager, env: Mapping[str, str]) -> None:
    selection = _Selection.from_environ(env)
    found: list[PluginOrigin] = []
    for entry_point in sorted(_entry_points(), key=lambda ep: ep.name):
        origin = _origin_of(entry_point)
        found.append(origin)
        reason = selection.reason_to_skip(origin)
        if reason is None:
            reason = _load_one(pm, entry_point, origin)
        if reason is not None:
            pm.note_not_loaded(origin, reason)
            if pm.trace_calls:
                logger.debug("did not load %s: %s", origin.describe(), reason)
    # A misspelled name in either switch would otherwise block or limit nothing, silently.
    for switch, listed in ((ENV_DISABLE, selection.blocked), (ENV_LOAD, selection.only or ())):
        for name in sorted(listed):
            if name == BUILTINS_NAME and switch == ENV_DISABLE:
                pm.warn(f"{ENV_DISABLE} names {name!r}: shard-core's built-ins are never blocked")
            elif not any(_matches(name, origin) for origin in found):
                installed = ", ".join(sorted(o.describe() for o in found)) or "none"
                pm.warn(
                    f"{switch} names {name!r}, but no installed shard plugin has that "
                    f"entry-point or distribution name; installed: {installed}"
                )


def _load_one(pm: ShardPluginManager, entry_point: _EntryPoint, origin: PluginOrigin) -> str | None:
    """Import and register one entry point; the reason it was skipped, or ``None``."""
    who = origin.describe()
    try:
        plugin = entry_point.load()
    except Exception as exc:
        reason = f"failed to load: {type(exc).__name__}: {exc}"
        pm.warn(f"{who} {reason}; it was skipped. {_fix(origin)}")
        return reason
    try:
        registered = pm.register(plugin, name=origin.entry_point, origin=origin)
    except Exception as exc:  # pluggy: name taken, object registered twice, a hook it refuses
        reason = f"could not be registered: {type(exc).__name__}: {exc}"
        pm.warn(f"{who} {reason}; it was skipped. {_fix(origin)}")
        return reason
    if registered is None:  # no valid hook; register() warned
        return pm.rejection(origin.entry_point) or "no valid hook"
    if entry_point.dist is not None:
        pm.note_distribution(plugin, entry_point.dist)
    if pm.trace_calls:
        logger.debug("loaded %s", who)
    return None


def _fix(origin: PluginOrigin | None) -> str:
    if origin is None:
        return "Fix the plugin."
    owner = origin.distribution or "the plugin"
    return (
        f"Fix or uninstall {owner}, or block it with {ENV_DISABLE}={origin.entry_point} "
        f"to silence this warning."
    )


def _enable_trace_output() -> None:
    """Make DEBUG records of the ``shard.plugin`` logger visible, without overriding user config."""
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.DEBUG)
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger.addHandler(handler)
