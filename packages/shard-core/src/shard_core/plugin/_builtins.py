"""shard-core's own plugin: the CPU device handle and the built-in wrap policies.

Built-ins register through the same hooks as third-party plugins, so there is
one path to every extension, a third-party name that clashes with a built-in
one is caught like any other collision, and ``SHARD_TRACE_PLUGINS`` shows
them too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from shard_core._cpu import CpuDeviceHandle
from shard_core._policies import LambdaWrapPolicy, ModuleWrapPolicy
from shard_core.plugin.hookspecs import hookimpl
from shard_core.protocols import DeviceHandle, WrapPolicy

__all__ = ["shard_device_handle", "shard_wrap_policies"]

_CPU = CpuDeviceHandle()


@hookimpl
def shard_wrap_policies() -> Mapping[str, Callable[..., WrapPolicy]]:
    """``"module_class"`` (option ``module_classes=``) and ``"lambda"`` (option ``fn=``)."""
    return {"lambda": LambdaWrapPolicy, "module_class": ModuleWrapPolicy}


@hookimpl(trylast=True)
def shard_device_handle(device_type: str) -> DeviceHandle | None:
    """The CPU handle for ``"cpu"``, asked after every third-party plugin."""
    return _CPU if device_type == "cpu" else None
