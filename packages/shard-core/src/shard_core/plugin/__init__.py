"""shard's plugin registry: hook specifications, the shared manager and its typed facade.

Plugins implement the hooks in :mod:`shard_core.plugin.hookspecs` with
:data:`hookimpl` and register under the entry-point group ``shard``; shard
code reads what they provide through :func:`get_registry`.
"""

from shard_core.errors import PluginCallError, PluginWarning
from shard_core.plugin._blame import plugin_call_error
from shard_core.plugin._global import get_plugin_manager, get_registry, reset_plugin_manager
from shard_core.plugin._manager import BUILTINS_NAME, PluginOrigin, make_plugin_manager
from shard_core.plugin._owned import SHARD_OWNED_NAMES
from shard_core.plugin._registry import Registry, check_options
from shard_core.plugin.hookspecs import PROJECT_NAME, hookimpl, hookspec

__all__ = [
    "BUILTINS_NAME",
    "PROJECT_NAME",
    "SHARD_OWNED_NAMES",
    "PluginCallError",
    "PluginOrigin",
    "PluginWarning",
    "Registry",
    "check_options",
    "get_plugin_manager",
    "get_registry",
    "hookimpl",
    "hookspec",
    "make_plugin_manager",
    "plugin_call_error",
    "reset_plugin_manager",
]
