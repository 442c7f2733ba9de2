"""Which device handle this process uses, resolved once through the plugin registry.

The runtime asks for the device handle on every unit and every step, and
resolving one walks the plugin registry, so the answer is cached per device
type. With no device type, the handle is that of the current accelerator
(``torch.accelerator``) when one is present, a plugin serves it and it is
usable; otherwise the built-in CPU handle.
"""

from __future__ import annotations

import threading

import torch

from shard_core import get_registry
from shard_core.errors import UnknownPluginNameError
from shard_core.protocols import DeviceHandle

__all__ = ["clear_device_handle_cache", "current_accelerator_type", "get_device_handle"]

_LOCK = threading.Lock()
# device type -> handle; the key None caches the resolution of "the current device".
_HANDLES: dict[str | None, DeviceHandle] = {}


def current_accelerator_type() -> str | None:
    """The type of ``torch.accelerator.current_accelerator()``, or ``None`` without one."""
    accelerator = torch.accelerator.current_accelerator()
    return None if accelerator is None else accelerator.type


def _resolve_default() -> DeviceHandle:
    accelerator = current_accelerator_type()
    if accelerator is not None:
        try:
            handle = get_registry().device_handle(accelerator)
        except UnknownPluginNameError:
            handle = None
        if handle is not None and handle.is_available():
            return handle
    return get_registry().device_handle("cpu")


def get_device_handle(device_type: str | None = None) -> DeviceHandle:
    """The device handle for ``device_type`` (``"cuda"``, ``"cuda:1"`` and ``"cpu"`` work).

    ``None``: the current accelerator's handle if one is present and handled
    by a plugin, else the CPU handle. Cached per device type; an unknown type
    raises :class:`~shard_core.errors.UnknownPluginNameError` from the
    registry, which says what to install.
    """
    key = None if device_type is None else torch.device(device_type).type
    handle = _HANDLES.get(key)
    if handle is not None:
        return handle
    with _LOCK:
        handle = _HANDLES.get(key)
        if handle is None:
            handle = _resolve_default() if key is None else get_registry().device_handle(key)
            _HANDLES[key] = handle
        return handle


def clear_device_handle_cache() -> None:
    """Forget resolved handles (after registering a device plugin at run time, say)."""
    with _LOCK:
        _HANDLES.clear()
