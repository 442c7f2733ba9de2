"""shard's plugin registry: hook specifications, the shared manager and its typed facade.

Plugins implement the hooks in :mod:`shard_core.plugin.hookspecs` with
:data:`hookimpl` and register under the entry-point group ``shard``; shard
code reads what they provide through :func:`get_registry`.
"""

from shard_core.errors import PluginWarning
from shard_core.plugin._global import get_plugin_manager, get_registry, reset_plugin_manager
from shard_core.plugin._manager import BUILTINS_NAME, PluginOrigin, make_plugin_manager
from shard_core.plugin._registry import Registry
from shard_core.plugin.hookspecs import PROJECT_NAME, hookimpl, hookspec

__all__ = [
    "BUILTINS_NAME",
    "PROJECT_NAME",
    "PluginOrigin",
    "PluginWarning",
    "Registry",
    "get_plugin_manager",
    "get_registry",
    "hookimpl",
    "hookspec",
    "make_plugin_manager",
    "reset_plugin_manager",
]
