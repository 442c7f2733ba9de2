"""The typed facade over shard's plugin manager.

Every lookup of a plugin-provided extension goes through :class:`Registry`,
never through ``pm.hook.<name>`` at the call site. The facade merges the
answers of all plugins; keeps the valid entries of an answer and skips (with
a :class:`~shard_core.plugin.PluginWarning` naming the distribution and
entry point) each malformed one, and the answer of a hook that raises;
disables only a name two plugins claim; and, when nothing answers, says
which distribution to install.
"""

from __future__ import annotations

import difflib
import inspect
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy

from shard_core.errors import (
    PluginCollisionError,
    PluginError,
    ShardError,
    UnknownPluginNameError,
    WrapPlanError,
)
from shard_core.plugin import _report
from shard_core.plugin._blame import plugin_call_error
from shard_core.plugin._manager import (
    ENV_DISABLE,
    ShardPluginManager,
    describe_plugin,
    is_builtin,
    logger,
)
from shard_core.plugin._owned import from_repository, owning_distribution
from shard_core.protocols import CommCodec, CommHook, DeviceHandle, StateDictBackend, WrapPolicy

__all__ = ["Registry", "check_options"]

# [Note: calling hooks one plugin at a time]
# pluggy's own hook call returns a bare list of results and stops at the first
# exception, so it can neither say which plugin answered what nor skip a
# plugin that raised. The registry therefore calls each implementation itself,
# in pluggy's order (last registered first; tryfirst/trylast honored), which
# is what lets every warning and collision name the distribution. Hook
# wrappers are not supported on shard's hooks: they are reported and ignored.

# [Note: names two plugins claim]
# A name claimed twice must not break the lookups of every other name, so
# only that name is disabled: the registry warns once (naming both
# distributions and entry points) and a lookup of that very name raises
# PluginCollisionError saying how to resolve it. Neither claimant is chosen,
# because any choice would depend on installation order and could silently
# change which code trains the model. A built-in name is the exception: a
# third-party plugin must not be able to replace shard-core's own policy
# under the name a user's script relies on, so the built-in keeps the name
# and the plugin is warned about.


def _callable_problem(name: str, value: object) -> str | None:
    if not callable(value):
        return f"{name!r} maps to {value!r} ({type(value).__name__}), which is not callable"
    return None


@dataclass(frozen=True, slots=True)
class _NamedHook:
    """A hook whose answer maps names to extensions (wrap-policy factories, comm hooks).

    Every such hook goes through the same merge (see [Note: names two plugins
    claim]) and the same lookup; a new one is a hook specification, a row of
    :data:`_NAMED_HOOKS`, and two typed methods on :class:`Registry` that call
    :meth:`Registry._entries` and :meth:`Registry._lookup`.

    Attributes:
        hook: The hook's name (``"shard_wrap_policies"``).
        kind: How messages name one entry (``"wrap policy"``).
        values: How messages name the answer's values (``"wrap-policy factories"``).
        check: The problem with one ``(name, value)`` entry, or ``None``.
    """

    hook: str
    kind: str
    values: str
    check: Callable[[str, object], str | None] = _callable_problem


_NAMED_HOOKS: dict[str, _NamedHook] = {
    spec.hook: spec
    for spec in (
        _NamedHook("shard_comm_codecs", "comm codec", "comm-codec factories"),
        _NamedHook("shard_comm_hooks", "comm hook", "comm hooks"),
        _NamedHook("shard_wrap_policies", "wrap policy", "wrap-policy factories"),
    )
}


@dataclass(frozen=True, slots=True)
class _Claim:
    """One plugin's entry under one name."""

    value: Any
    plugin_name: str


@dataclass(slots=True)
class _Table:
    """The merged answers of one named hook: usable entries and disabled (colliding) names."""

    entries: dict[str, _Claim] = field(default_factory=dict)
    collisions: dict[str, list[_Claim]] = field(default_factory=dict)


class Registry:
    """Typed access to what the plugins registered on ``pm`` provide.

    Built on any ``pluggy.PluginManager`` for project ``shard`` (unit tests
    build one in memory with ``make_plugin_manager(load_entry_points=False)``).
    Answers are cached until a plugin is registered or unregistered, so a
    malformed plugin is reported once and a device handle is one object.
    Thread-safe.
    """

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self._pm = pm
        self._lock = threading.RLock()
        self._plugins: list[tuple[str, object]] = []
        self._tables: dict[str, _Table] = {}  # by hook name
        self._device_handles: dict[str, DeviceHandle] = {}
        self._warned: set[str] = set()  # for a manager that is not a ShardPluginManager

    def __repr__(self) -> str:
        return f"Registry(plugins={self.plugin_names()!r})"

    @property
    def plugin_manager(self) -> pluggy.PluginManager:
        """The manager this registry reads."""
        return self._pm

    def plugin_names(self) -> list[str]:
        """Names of the registered plugins, sorted: entry-point names, and ``"builtins"``."""
        return sorted(name for name, plugin in self._pm.list_name_plugin() if plugin is not None)

    # - wrap policies

    def wrap_policies(self) -> dict[str, Callable[..., WrapPolicy]]:
        """Every usable wrap-policy factory, by name (sorted).

        A name two plugins claim is left out (see [Note: names two plugins claim]).
        """
        return self._entries("shard_wrap_policies")

    def wrap_policy(self, name: str, /, **options: Any) -> WrapPolicy:
        """Build the wrap policy registered as ``name`` with keyword ``options``.

        Raises:
            UnknownPluginNameError: no plugin registered ``name``; the message
                lists the names that are registered, and names the
                distribution to install for a name of shard's own plugins.
            PluginCollisionError: two plugins registered ``name``.
            WrapPlanError: the factory does not take ``options`` (the message
                gives its options), or rejects their values.
            PluginCallError: the factory raised another exception (chained;
                also an instance of that exception's built-in category).
            PluginError: the factory built something that is not a
                :class:`~shard_core.protocols.WrapPolicy`.
        """
        claim = self._lookup("shard_wrap_policies", name)
        factory = claim.value
        check_options(f"wrap policy {name!r}", factory, options)
        try:
            policy = factory(**options)
        except ShardError:
            raise
        except Exception as exc:
            raise plugin_call_error(
                exc,
                f"wrap policy {name!r} of {self._describe(claim.plugin_name)}",
                f" when built with the options {options!r}",
            ) from exc
        if not isinstance(policy, WrapPolicy):
            raise PluginError(
                f"wrap policy {name!r} of {self._describe(claim.plugin_name)} built "
                f"{policy!r} ({type(policy).__name__}), which is not a WrapPolicy "
                f"(it needs descend() and wrap()); report this to the plugin's authors"
            )
        return policy

    # - comm hooks

    def comm_hooks(self) -> dict[str, CommHook]:
        """Every usable gradient comm hook, by name (sorted).

        A name two plugins claim is left out (see [Note: names two plugins claim]).
        """
        return self._entries("shard_comm_hooks")

    def comm_hook(self, name: str) -> CommHook:
        """The comm hook registered as ``name``.

        Raises:
            UnknownPluginNameError: no plugin registered ``name``; the message
                lists the names that are registered, and names the
                distribution to install for a name of shard's own plugins.
            PluginCollisionError: two plugins registered ``name``.
        """
        value: CommHook = self._lookup("shard_comm_hooks", name).value
        return value

    # - comm codecs

    def comm_codecs(self) -> dict[str, Callable[..., CommCodec]]:
        """Every usable comm-codec factory, by name (sorted).

        A name two plugins claim is left out (see [Note: names two plugins claim]).
        """
        return self._entries("shard_comm_codecs")

    def comm_codec(self, name: str, /, **options: Any) -> CommCodec:
        """Build the comm codec registered as ``name`` with keyword ``options``.

        Raises:
            UnknownPluginNameError: no plugin registered ``name``; the message
                lists the names that are registered, and names the
                distribution to install for a name of shard's own plugins.
            PluginCollisionError: two plugins registered ``name``.
            PluginCallError: the factory raised (chained; also an instance of
                that exception's built-in category).
            PluginError: the factory built something that is not a
                :class:`~shard_core.protocols.CommCodec`.
        """
        claim = self._lookup("shard_comm_codecs", name)
        check_options(f"comm codec {name!r}", claim.value, options)
        try:
            codec = claim.value(**options)
        except ShardError:
            raise
        except Exception as exc:
            raise plugin_call_error(
                exc,
                f"comm codec {name!r} of {self._describe(claim.plugin_name)}",
                f" when built with the options {options!r}",
            ) from exc
        if not isinstance(codec, CommCodec):
            raise PluginError(
                f"comm codec {name!r} of {self._describe(claim.plugin_name)} built "
                f"{codec!r} ({type(codec).__name__}), which is not a CommCodec "
                f"(it needs encoded_nbytes(), encode() and decode()); report this to the "
                f"plugin's authors"
            )
        return codec

    # - device handles

    def device_handle(self, device_type: str) -> DeviceHandle:
        """The handle of the first plugin that serves ``device_type`` (``"cpu"``, ``"cuda"``...).

        Third-party plugins are asked before the built-in CPU handle. A
        plugin whose answer is not a :class:`~shard_core.protocols.DeviceHandle`
        for ``device_type`` is reported and the next one is asked.

        Raises:
            UnknownPluginNameError: no plugin serves ``device_type``; the
                message names the distribution to install where one is known.
        """
        with self._lock:
            self._forget_if_plugins_changed()
            handle = self._device_handles.get(device_type)
            if handle is not None:
                return handle
            for name, answer in self._answers("shard_device_handle", device_type=device_type):
                problem = _device_handle_problem(answer, device_type)
                if problem is not None:
                    self._warn_malformed(name, "shard_device_handle", problem)
                    continue
                assert isinstance(answer, DeviceHandle)
                self._device_handles[device_type] = answer
                return answer
        raise UnknownPluginNameError(self._no_device_message(device_type))

    # - state dicts of the wrapper

    def state_dict_backend(self) -> StateDictBackend:
        """The state-dict backend of the first plugin that provides one (shard-checkpoint).

        A plugin whose answer is not a :class:`~shard_core.protocols.StateDictBackend`
        is reported and the next one is asked.

        Raises:
            UnknownPluginNameError: no plugin provides one; the message says to
                install shard-checkpoint.
        """
        with self._lock:
            self._forget_if_plugins_changed()
            for name, answer in self._answers("shard_state_dict_backend"):
                if not isinstance(answer, StateDictBackend):
                    self._warn_malformed(
                        name,
                        "shard_state_dict_backend",
                        f"{type(answer).__name__} is not a StateDictBackend (see "
                        "shard_core.protocols: model_state_dict, load_model_state_dict)",
                    )
                    continue
                return answer
        raise UnknownPluginNameError(
            "no shard plugin provides the state dicts of FullyShardedDataParallel (full and "
            f"sharded); plugins asked: {', '.join(self.plugin_names())}. Install "
            f"shard-checkpoint {from_repository('shard-checkpoint', 'packages')}, or use "
            "StateDictType.LOCAL_STATE_DICT, which needs no plugin"
        )

    def _no_device_message(self, device_type: str) -> str:
        base = f"no shard plugin serves device type {device_type!r}"
        distribution = owning_distribution("shard_device_handle", device_type)
        if distribution is None:
            return (
                f"{base}; plugins asked: {', '.join(self.plugin_names())}. A plugin provides "
                f"a device handle through the shard_device_handle hook"
            )
        state = self._distribution_state(distribution)
        if state == "":
            return (
                f"{base}: {distribution} is installed but did not serve it; is a "
                f"{device_type!r} device present, and supported by this build of torch?"
            )
        if state is not None:
            return f"{base}: {distribution} is installed but was not loaded ({state})"
        return f"{base}: install {distribution} {from_repository(distribution)}"

    # - named hooks (see _NamedHook)

    def _entries(self, hook_name: str) -> dict[str, Any]:
        """The usable entries of a named hook, by name (sorted)."""
        return {name: claim.value for name, claim in self._table(hook_name).entries.items()}

    def _lookup(self, hook_name: str, name: str) -> _Claim:
        """The one claim on ``name`` of a named hook.

        Raises:
            UnknownPluginNameError: nobody claims it.
            PluginCollisionError: several plugins claim it.
        """
        table = self._table(hook_name)
        claim = table.entries.get(name)
        if claim is not None:
            return claim
        spec = _NAMED_HOOKS[hook_name]
        claims = table.collisions.get(name)
        if claims is not None:
            raise PluginCollisionError(
                f"{spec.kind} {name!r} is registered by {self._both(claims)}, so it is "
                f"disabled: names must be unique across plugins. "
                f"{self._resolve_collision(claims)}"
            )
        raise UnknownPluginNameError(self._unknown_message(spec, name, table))

    def _table(self, hook_name: str) -> _Table:
        """:meth:`_collect` once, until the registered plugins change."""
        with self._lock:
            self._forget_if_plugins_changed()
            table = self._tables.get(hook_name)
            if table is None:
                table = self._tables[hook_name] = self._collect(_NAMED_HOOKS[hook_name])
            return table

    def _collect(self, spec: _NamedHook) -> _Table:
        """Merge the mappings plugins return from ``spec.hook``, in registration order."""
        claims: dict[str, list[_Claim]] = {}
        for plugin_name, answer in reversed(list(self._answers(spec.hook))):
            for name, value in self._valid_entries(spec, plugin_name, answer).items():
                claims.setdefault(name, []).append(_Claim(value, plugin_name))
        table = _Table()
        for name, claimed in sorted(claims.items()):
            builtin = next((c for c in claimed if is_builtin(self._pm, c.plugin_name)), None)
            if len(claimed) == 1 or builtin is not None:
                table.entries[name] = builtin or claimed[0]
                for claim in claimed:
                    if claim is not builtin and builtin is not None:
                        self._warn_shadowing(spec, name, claim.plugin_name)
                continue
            table.collisions[name] = claimed
            self._warn(
                f"{spec.kind} {name!r} is registered by {self._both(claimed)}, so neither is "
                f"used; every other {spec.kind} works. {self._resolve_collision(claimed)}"
            )
        return table

    def _valid_entries(self, spec: _NamedHook, plugin_name: str, answer: object) -> dict[str, Any]:
        """The valid entries of one plugin's answer; each invalid one is skipped, all reported."""
        if not isinstance(answer, Mapping):
            self._warn_malformed(
                plugin_name,
                spec.hook,
                f"expected a mapping of names to {spec.values}, got {type(answer).__name__}",
            )
            return {}
        valid: dict[str, Any] = {}
        problems: list[str] = []
        try:
            items = list(answer.items())
        except Exception as exc:
            self._warn_malformed(
                plugin_name, spec.hook, f"reading the mapping raised {type(exc).__name__}: {exc}"
            )
            return {}
        for name, value in items:
            if not isinstance(name, str) or not name:
                problems.append(
                    f"names must be non-empty strings, got {name!r} ({type(name).__name__})"
                )
                continue
            problem = spec.check(name, value)
            if problem is not None:
                problems.append(problem)
                continue
            valid[name] = value
        if problems:
            kept = f", its other entries are used ({', '.join(map(repr, valid))})" if valid else ""
            these = "this entry was" if len(problems) == 1 else f"these {len(problems)} were"
            self._warn(
                f"{self._describe(plugin_name)} returned malformed entries from {spec.hook}(): "
                f"{'; '.join(problems)}; {these} skipped{kept}. {self._fix(plugin_name)}"
            )
        return valid

    # - internals

    def _forget_if_plugins_changed(self) -> None:
        plugins = [(name, plugin) for name, plugin in self._pm.list_name_plugin()]
        same = len(plugins) == len(self._plugins) and all(
            a[0] == b[0] and a[1] is b[1] for a, b in zip(plugins, self._plugins, strict=True)
        )
        if not same:
            self._plugins = plugins
            self._tables = {}
            self._device_handles = {}

    def _answers(self, hook_name: str, **kwargs: object) -> Iterator[tuple[str, object]]:
        """Call each implementation of ``hook_name``; yield (plugin name, answer) when not ``None``.

        See [Note: calling hooks one plugin at a time].
        """
        caller: pluggy.HookCaller = getattr(self._pm.hook, hook_name)
        trace = isinstance(self._pm, ShardPluginManager) and self._pm.trace_calls
        call = f"{hook_name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
        for impl in reversed(caller.get_hookimpls()):
            who = self._describe(impl.plugin_name)
            if impl.wrapper or impl.hookwrapper:
                self._warn(
                    f"{who} wraps {hook_name}(); shard's registry calls each plugin's hook "
                    f"on its own and ignores hook wrappers: implement the hook itself instead"
                )
                continue
            try:
                answer = impl.function(*(kwargs[arg] for arg in impl.argnames))
            except Exception as exc:
                if trace:
                    logger.debug("%s: %s raised", call, who, exc_info=True)
                self._warn(
                    f"{who} raised {type(exc).__name__}: {exc} in {hook_name}(); its answer "
                    f"was skipped. {self._fix(impl.plugin_name)}"
                )
                continue
            if trace:
                logger.debug("%s: %s answered %r", call, who, answer)
            if answer is not None:
                yield impl.plugin_name, answer

    def _warn(self, message: str) -> None:
        """Show ``message`` once (see [Note: where plugin warnings show])."""
        if isinstance(self._pm, ShardPluginManager):
            self._pm.warn(message)
        elif message not in self._warned:
            self._warned.add(message)
            _report.emit(message, os.environ)

    def _describe(self, plugin_name: str) -> str:
        return describe_plugin(self._pm, plugin_name)

    def _entry_point(self, plugin_name: str) -> str | None:
        """The entry-point name of a plugin loaded from one (what SHARD_DISABLE_PLUGINS takes)."""
        if not isinstance(self._pm, ShardPluginManager):
            return None
        origin = self._pm.origin(plugin_name)
        return origin.entry_point if origin is not None else None

    def _fix(self, plugin_name: str) -> str:
        origin = self._pm.origin(plugin_name) if isinstance(self._pm, ShardPluginManager) else None
        if origin is None:
            return "Report this to the plugin's authors."
        owner = origin.distribution or "the plugin"
        return (
            f"Report this to the authors of {owner}, or block it with "
            f"{ENV_DISABLE}={origin.entry_point}."
        )

    def _warn_malformed(self, plugin_name: str, hook_name: str, problem: str) -> None:
        self._warn(
            f"{self._describe(plugin_name)} returned a malformed value from {hook_name}(): "
            f"{problem}; it was skipped. {self._fix(plugin_name)}"
        )

    def _warn_shadowing(self, spec: _NamedHook, name: str, plugin_name: str) -> None:
        entry_point = self._entry_point(plugin_name)
        who = self._describe(plugin_name)
        if entry_point is None:
            fix = "Rename it in the plugin."
        else:
            fix = (
                f"Rename it in the plugin, or block the plugin with {ENV_DISABLE}={entry_point} "
                f"to silence this warning."
            )
        self._warn(
            f"{who} registers {spec.kind} {name!r}, a name built into shard-core, so the "
            f"built-in is used and the plugin's {spec.kind} is ignored. {fix}"
        )

    def _both(self, claims: list[_Claim]) -> str:
        """``"both A and B"``, or ``"A, B and C"``: the plugins claiming one name."""
        names = [self._describe(c.plugin_name) for c in claims]
        listed = f"{', '.join(names[:-1])} and {names[-1]}"
        return f"both {listed}" if len(names) == 2 else listed

    def _resolve_collision(self, claims: list[_Claim]) -> str:
        entry_points = [e for c in claims if (e := self._entry_point(c.plugin_name)) is not None]
        if not entry_points:
            return "Register the name in one plugin only."
        blocks = " or ".join(f"{ENV_DISABLE}={e}" for e in entry_points)
        if len(claims) == 2:
            return f"Uninstall one of them, or block one with {blocks}."
        return f"Uninstall all of them but one, or block the others with {blocks}."

    def _unknown_message(self, spec: _NamedHook, name: str, table: _Table) -> str:
        registered = ", ".join(repr(n) for n in table.entries) or "none"
        message = f"no {spec.kind} is registered as {name!r}; registered: {registered}"
        distribution = owning_distribution(spec.hook, name) if isinstance(name, str) else None
        if distribution is not None:
            return f"{message}. {name!r} is provided by {self._how_to_get(distribution)}"
        names = list(table.entries)
        close = difflib.get_close_matches(name, names, n=1) if isinstance(name, str) else []
        if close:
            return f"{message}. Did you mean {close[0]!r}?"
        return f"{message}. Install the plugin that provides {name!r}"

    def _how_to_get(self, distribution: str) -> str:
        """``distribution``, and why it did not answer: not installed, not loaded, or loaded."""
        state = self._distribution_state(distribution)
        if state is None:
            return f"{distribution}: install it {from_repository(distribution)}"
        if state == "":
            return (
                f"{distribution}, which is loaded but did not register it: see the "
                f"PluginWarning about {distribution}, or update it"
            )
        return f"{distribution}, which is installed but was not loaded ({state})"

    def _distribution_state(self, distribution: str) -> str | None:
        """``""``: loaded; a reason: found but not loaded; ``None``: not found."""
        if not isinstance(self._pm, ShardPluginManager):
            return None
        for name in self.plugin_names():
            origin = self._pm.origin(name)
            if origin is not None and origin.distribution == distribution:
                return ""
        for origin, reason in self._pm.not_loaded():
            if origin.distribution == distribution:
                return reason
        return None


def _device_handle_problem(answer: object, device_type: str) -> str | None:
    """What is wrong with a ``shard_device_handle`` answer, or ``None``."""
    if not isinstance(answer, DeviceHandle):
        return (
            f"{type(answer).__name__} is not a DeviceHandle (see shard_core.protocols: "
            f"device_type, backend, streams, events, memory_stats...)"
        )
    served = answer.device_type
    if served != device_type:
        return f"asked for device type {device_type!r}, it answered a handle for {served!r}"
    return None


def check_options(subject: str, factory: Callable[..., object], options: Mapping[str, Any]) -> None:
    """Raise a :class:`WrapPlanError` when ``factory`` cannot be called with keyword ``options``.

    The one check of a named policy's options, for the registry and every
    front end above it: the message names ``subject`` (``"wrap policy
    'size'"``), the options given, what is wrong and the options the factory
    takes, with their defaults. A factory without a signature to read (a
    builtin) is not checked: its call will tell.
    """
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    parameters = signature.parameters.values()
    by_keyword = {
        p.name: p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    problems = []
    if not any(p.kind is p.VAR_KEYWORD for p in parameters):
        problems += [
            f"got an unexpected keyword argument {k!r}" for k in options if k not in by_keyword
        ]
    problems += [
        f"missing a required argument: {p.name!r}"
        for p in parameters
        if p.default is p.empty
        and p.name not in options
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if problems:
        raise WrapPlanError(
            f"{subject} does not take the options {dict(options)!r}: {'; '.join(problems)}; its "
            f"options are: {_describe_options(signature)}"
        )


def _describe_options(signature: inspect.Signature) -> str:
    """The keyword arguments ``signature`` takes: ``"pattern"``, ``"min_num_params=100"``."""
    described = []
    for parameter in signature.parameters.values():
        if parameter.kind is parameter.VAR_KEYWORD:
            described.append(f"**{parameter.name}")
        elif parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
            if parameter.default is parameter.empty:
                described.append(parameter.name)
            else:
                described.append(f"{parameter.name}={parameter.default!r}")
    return ", ".join(described) or "none"
