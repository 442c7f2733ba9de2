"""The process-wide plugin manager and registry, built on first use.

Importing ``shard_core`` must stay cheap and must never run third-party code,
so entry points are loaded the first time anything asks for the manager,
once, under a lock (two threads asking at once get the same manager).
"""

from __future__ import annotations

import threading

import pluggy

from shard_core.errors import PluginError
from shard_core.plugin._manager import make_plugin_manager
from shard_core.plugin._registry import Registry

__all__ = ["get_plugin_manager", "get_registry", "reset_plugin_manager"]

_lock = threading.RLock()
_manager: pluggy.PluginManager | None = None
_registry: Registry | None = None
_building = False


def get_plugin_manager() -> pluggy.PluginManager:
    """The shared plugin manager: built-ins and every allowed entry point of group ``shard``.

    Built on the first call (reading the ``SHARD_*_PLUGINS`` switches then);
    later calls return the same manager until :func:`reset_plugin_manager`.

    Raises:
        PluginError: called by a plugin while it is being loaded (a plugin
            must not use the registry at import time); the loader reports it
            as a warning naming the plugin and skips that plugin.
    """
    global _manager, _building
    manager = _manager
    if manager is not None:
        return manager
    with _lock:
        if _manager is None:
            if _building:
                raise PluginError(
                    "get_plugin_manager() was called while shard's plugins are being loaded, "
                    "from a plugin's import; a plugin must not use the registry when it is "
                    "imported: do it inside a hook or a function instead"
                )
            _building = True
            try:
                _manager = make_plugin_manager()
            finally:
                _building = False
        return _manager


def get_registry() -> Registry:
    """The :class:`~shard_core.plugin.Registry` over :func:`get_plugin_manager`, cached."""
    global _registry
    with _lock:
        manager = get_plugin_manager()
        if _registry is None or _registry.plugin_manager is not manager:
            _registry = Registry(manager)
        return _registry


def reset_plugin_manager() -> None:
    """Forget the shared manager and registry; the next use builds them again (for tests).

    Plugin modules already imported stay imported; a new manager registers
    them again, under the environment switches as they are then.
    """
    global _manager, _registry
    with _lock:
        _manager = None
        _registry = None
