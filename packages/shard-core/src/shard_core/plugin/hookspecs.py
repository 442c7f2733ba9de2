"""The hook specifications of shard's plugin registry.

Every hook a plugin may implement is declared here, once, typed and
documented; nothing else in the project defines a hook. Built-in
implementations register through these same hooks.

Shard code never calls ``pm.hook.<name>``: :class:`shard_core.plugin.Registry`
calls each plugin's implementation on its own, so that an implementation
that raises is skipped, and a malformed entry of its answer dropped, with a
``PluginWarning`` naming its distribution. Hook wrappers
(``wrapper=True``/``hookwrapper=True``) are therefore not supported on these
hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pluggy

from shard_core.protocols import CommCodec, CommHook, DeviceHandle, StateDictBackend, WrapPolicy

__all__ = [
    "PROJECT_NAME",
    "hookimpl",
    "hookspec",
    "shard_comm_codecs",
    "shard_comm_hooks",
    "shard_device_handle",
    "shard_state_dict_backend",
    "shard_wrap_policies",
]

PROJECT_NAME = "shard"
"""The pluggy project name, which is also the entry-point group plugins register under."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marks a plugin's hook implementations. Import it as ``from shard_core import hookimpl``.

That is the one documented path (DESIGN.md, section 3; every plugin of this repository).
``shard_core.plugin.hookimpl`` and this module's name are the same object and
stay importable for plugins written against them; new code uses the top.
"""


@hookspec
def shard_wrap_policies() -> Mapping[str, Callable[..., WrapPolicy]]:
    """Return wrap-policy factories by name.

    Each factory takes keyword options (``min_num_params=...``) and builds a
    :class:`~shard_core.protocols.WrapPolicy`. The runtime looks policies up
    by name, so ``auto_wrap_policy="transformer"`` works. Names are unique
    across all plugins: a name two plugins claim is disabled (looking it up
    raises ``PluginCollisionError``), and a built-in name stays the built-in's.
    """
    raise NotImplementedError


@hookspec
def shard_comm_hooks() -> Mapping[str, CommHook]:
    """Return gradient comm hooks by name (``"bf16_compress"``, say).

    Code selects one by name with ``Registry.comm_hook("bf16_compress")``
    (``shard_comms.resolve_comm_hook`` for users). Names are unique across
    all plugins, as for :func:`shard_wrap_policies`.
    """
    raise NotImplementedError


@hookspec
def shard_comm_codecs() -> Mapping[str, Callable[..., CommCodec]]:
    """Return comm-codec factories by name (``"int8"``, say).

    Each factory takes keyword options (``block_size=...``) and builds a
    :class:`~shard_core.protocols.CommCodec`, which encodes what a unit sends
    on the wire: ``FSDPModule.set_comm_codec(weights="int8", grads="int8")``
    quantizes its parameter all-gathers and gradient reductions. Code builds
    one with ``Registry.comm_codec("int8", block_size=256)``. Names are
    unique across all plugins.
    """
    raise NotImplementedError


@hookspec(firstresult=True)
def shard_device_handle(device_type: str) -> DeviceHandle | None:
    """Return a :class:`~shard_core.protocols.DeviceHandle` for ``device_type``.

    Return ``None`` for device types this plugin does not serve. The first
    non-``None`` answer wins; third-party plugins are asked before the
    built-in CPU handle. An answer that is not a ``DeviceHandle`` whose
    ``device_type`` is the one asked for is skipped with a warning, and the
    next plugin is asked.
    """
    raise NotImplementedError


@hookspec(firstresult=True)
def shard_state_dict_backend() -> StateDictBackend | None:
    """Return the :class:`~shard_core.protocols.StateDictBackend` of the wrapper front end.

    ``FullyShardedDataParallel.state_dict()`` and ``load_state_dict()`` reach
    the full and sharded state dicts through it (shard-checkpoint answers).
    The first non-``None`` answer that is a ``StateDictBackend`` wins; a
    malformed one is skipped with a warning and the next plugin is asked.
    """
    raise NotImplementedError
