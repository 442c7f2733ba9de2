"""The typed facade over shard's plugin manager.

Every lookup of a plugin-provided extension goes through :class:`Registry`,
never through ``pm.hook.<name>`` at the call site: the facade merges the
answers of all plugins, makes a name claimed twice an error, skips (with a
:class:`~shard_core.plugin.PluginWarning` naming the distribution) a plugin
whose hook raises or answers something malformed, and says which
distribution to install when nothing answers.
"""

from __future__ import annotations

import difflib
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import pluggy

from shard_core.errors import (
    PluginCollisionError,
    PluginError,
    PluginWarning,
    UnknownPluginNameError,
)
from shard_core.plugin._manager import ENV_DISABLE, ShardPluginManager, describe_plugin, logger
from shard_core.protocols import CommCodec, CommHook, DeviceHandle, StateDictBackend, WrapPolicy

__all__ = ["Registry"]

# [Note: calling hooks one plugin at a time]
# pluggy's own hook call returns a bare list of results and stops at the first
# exception, so it can neither say which plugin answered what nor skip a
# plugin that raised. The registry therefore calls each implementation itself,
# in pluggy's order (last registered first; tryfirst/trylast honored), which
# is what lets every warning and collision name the distribution. Hook
# wrappers are not supported on shard's hooks: they are reported and ignored.

_DEVICE_DISTRIBUTIONS = {
    "cuda": "shard-device-cuda",
    "xpu": "shard-device-accel",
    "hpu": "shard-device-accel",
    "npu": "shard-device-accel",
    "mps": "shard-device-accel",
}
"""The distribution that provides the device handle of each well-known device type."""


def _from_repository(distribution: str, folder: str = "plugins") -> str:
    """How to install ``distribution``: from this repository, as PyPI's shard names are not ours."""
    return (
        f"from the shard repository (pip install ./{folder}/{distribution} in a checkout; "
        "the shard names on PyPI belong to unrelated projects)"
    )


_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class _Named(Generic[_T]):
    """One named extension and the plugin it came from."""

    value: _T
    plugin_name: str


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
        self._named: dict[str, dict[str, _Named[Any]]] = {}  # by hook name
        self._device_handles: dict[str, DeviceHandle] = {}

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
        """Every registered wrap-policy factory, by name (sorted).

        Raises:
            PluginCollisionError: two plugins registered the same name.
        """
        return {name: named.value for name, named in self._wrap_policy_entries().items()}

    def wrap_policy(self, name: str, /, **options: Any) -> WrapPolicy:
        """Build the wrap policy registered as ``name`` with keyword ``options``.

        Raises:
            UnknownPluginNameError: no plugin registered ``name``; the message
                lists the names that are registered.
            PluginError: the factory built something that is not a
                :class:`~shard_core.protocols.WrapPolicy`.
        """
        entries = self._wrap_policy_entries()
        named = entries.get(name)
        if named is None:
            raise UnknownPluginNameError(_unknown_name("wrap policy", name, entries))
        policy = named.value(**options)
        if not isinstance(policy, WrapPolicy):
            raise PluginError(
                f"wrap policy {name!r} of {self._describe(named.plugin_name)} built "
                f"{policy!r} ({type(policy).__name__}), which is not a WrapPolicy "
                f"(it needs descend() and wrap()); report this to the plugin's authors"
            )
        return policy

    # - comm hooks

    def comm_hooks(self) -> dict[str, CommHook]:
        """Every registered gradient comm hook, by name (sorted).

        Raises:
            PluginCollisionError: two plugins registered the same name.
        """
        return {name: named.value for name, named in self._comm_hook_entries().items()}

    def comm_hook(self, name: str) -> CommHook:
        """The comm hook registered as ``name``.

        Raises:
            UnknownPluginNameError: no plugin registered ``name``; the message
                lists the names that are registered.
        """
        entries = self._comm_hook_entries()
        named = entries.get(name)
        if named is None:
            raise UnknownPluginNameError(_unknown_name("comm hook", name, entries))
        return named.value

    # - comm codecs

    def comm_codecs(self) -> dict[str, Callable[..., CommCodec]]:
        """Every registered comm-codec factory, by name (sorted).

        Raises:
            PluginCollisionError: two plugins registered the same name.
        """
        entries = self._named_entries("shard_comm_codecs", "comm codec", "comm-codec factories")
        return {name: named.value for name, named in entries.items()}

    def comm_codec(self, name: str, /, **options: Any) -> CommCodec:
        """Build the comm codec registered as ``name`` with keyword ``options``.

        Raises:
            UnknownPluginNameError: no plugin registered ``name``; the message
                lists the names that are registered.
            PluginError: the factory built something that is not a
                :class:`~shard_core.protocols.CommCodec`.
        """
        entries = self._named_entries("shard_comm_codecs", "comm codec", "comm-codec factories")
        named = entries.get(name)
        if named is None:
            raise UnknownPluginNameError(_unknown_name("comm codec", name, entries))
        codec = named.value(**options)
        if not isinstance(codec, CommCodec):
            raise PluginError(
                f"comm codec {name!r} of {self._describe(named.plugin_name)} built "
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
            f"shard-checkpoint {_from_repository('shard-checkpoint', 'packages')}, or use "
            "StateDictType.LOCAL_STATE_DICT, which needs no plugin"
        )

    # - internals

    def _wrap_policy_entries(self) -> dict[str, _Named[Callable[..., WrapPolicy]]]:
        return self._named_entries("shard_wrap_policies", "wrap policy", "wrap-policy factories")

    def _comm_hook_entries(self) -> dict[str, _Named[CommHook]]:
        return self._named_entries("shard_comm_hooks", "comm hook", "comm hooks")

    def _named_entries(self, hook_name: str, kind: str, values: str) -> dict[str, _Named[Any]]:
        """:meth:`_collect_named` once, until the registered plugins change."""
        with self._lock:
            self._forget_if_plugins_changed()
            entries = self._named.get(hook_name)
            if entries is None:
                entries = self._named[hook_name] = self._collect_named(hook_name, kind, values)
            return entries

    def _forget_if_plugins_changed(self) -> None:
        plugins = [(name, plugin) for name, plugin in self._pm.list_name_plugin()]
        same = len(plugins) == len(self._plugins) and all(
            a[0] == b[0] and a[1] is b[1] for a, b in zip(plugins, self._plugins, strict=True)
        )
        if not same:
            self._plugins = plugins
            self._named = {}
            self._device_handles = {}

    def _collect_named(self, hook_name: str, kind: str, values: str) -> dict[str, _Named[Any]]:
        """Merge the mappings plugins return from ``hook_name``, in registration order."""
        merged: dict[str, _Named[Any]] = {}
        for name, answer in reversed(list(self._answers(hook_name))):
            problem = _mapping_problem(answer, values)
            if problem is not None:
                self._warn_malformed(name, hook_name, problem)
                continue
            assert isinstance(answer, Mapping)
            for key, value in answer.items():
                if key in merged:
                    raise PluginCollisionError(
                        self._collision_message(kind, key, merged[key].plugin_name, name)
                    )
                merged[key] = _Named(value, name)
        return dict(sorted(merged.items()))

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
                _warn(
                    f"{who} wraps {hook_name}(); shard's registry calls each plugin's hook "
                    f"on its own and ignores hook wrappers: implement the hook itself instead"
                )
                continue
            try:
                answer = impl.function(*(kwargs[arg] for arg in impl.argnames))
            except Exception as exc:
                if trace:
                    logger.debug("%s: %s raised", call, who, exc_info=True)
                _warn(
                    f"{who} raised {type(exc).__name__}: {exc} in {hook_name}(); its answer "
                    f"was skipped. {self._fix(impl.plugin_name)}"
                )
                continue
            if trace:
                logger.debug("%s: %s answered %r", call, who, answer)
            if answer is not None:
                yield impl.plugin_name, answer

    def _describe(self, plugin_name: str) -> str:
        return describe_plugin(self._pm, plugin_name)

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
        _warn(
            f"{self._describe(plugin_name)} returned a malformed value from {hook_name}(): "
            f"{problem}; it was skipped. {self._fix(plugin_name)}"
        )

    def _collision_message(self, kind: str, key: str, first: str, second: str) -> str:
        blockable = [
            origin.entry_point
            for origin in (
                self._pm.origin(n) if isinstance(self._pm, ShardPluginManager) else None
                for n in (first, second)
            )
            if origin is not None
        ]
        if blockable:
            names = ", ".join(blockable)
            fix = f"uninstall one of them, or block one with {ENV_DISABLE}=<name> ({names})"
        else:
            fix = "register the name in one plugin only"
        return (
            f"{kind} {key!r} is registered by both {self._describe(first)} and "
            f"{self._describe(second)}; names must be unique across plugins, built-in names "
            f"included: {fix}"
        )

    def _no_device_message(self, device_type: str) -> str:
        base = f"no shard plugin serves device type {device_type!r}"
        distribution = _DEVICE_DISTRIBUTIONS.get(device_type)
        if distribution is None:
            return (
                f"{base}; plugins asked: {', '.join(self.plugin_names())}. A plugin provides "
                f"a device handle through the shard_device_handle hook"
            )
        if isinstance(self._pm, ShardPluginManager):
            loaded = {
                origin.distribution
                for name in self.plugin_names()
                if (origin := self._pm.origin(name)) is not None
            }
            if distribution in loaded:
                return (
                    f"{base}: {distribution} is installed but did not serve it; is a "
                    f"{device_type!r} device present, and supported by this build of torch?"
                )
            for origin, reason in self._pm.not_loaded():
                if origin.distribution == distribution:
                    return f"{base}: {distribution} is installed but was not loaded ({reason})"
        return f"{base}: install {distribution} {_from_repository(distribution)}"


def _mapping_problem(answer: object, values: str) -> str | None:
    """What is wrong with a hook's mapping answer, or ``None``."""
    if not isinstance(answer, Mapping):
        return f"expected a mapping of names to {values}, got {type(answer).__name__}"
    for key, value in answer.items():
        if not isinstance(key, str) or not key:
            return f"names must be non-empty strings, got {key!r} ({type(key).__name__})"
        if not callable(value):
            return f"{key!r} maps to {value!r} ({type(value).__name__}), which is not callable"
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


def _unknown_name(kind: str, name: str, entries: Mapping[str, object]) -> str:
    registered = ", ".join(repr(n) for n in entries) or "none"
    message = f"no {kind} is registered as {name!r}; registered: {registered}"
    close = difflib.get_close_matches(name, list(entries), n=1) if isinstance(name, str) else []
    if close:
        message += f". Did you mean {close[0]!r}?"
    else:
        message += f". Install the plugin that provides {name!r}"
    return message


def _warn(message: str) -> None:
    warnings.warn(message, PluginWarning, stacklevel=4)
