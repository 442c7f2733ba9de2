"""get_device_handle: resolution through the registry, accelerator fallback, caching."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

import shard_comms as sc
from shard_comms import _device, plumbing
from shard_core import CpuDeviceHandle
from shard_core.errors import UnknownPluginNameError


class _FakeXpu(CpuDeviceHandle):
    """A handle that claims device type 'xpu', usable or not."""

    def __init__(self, available: bool) -> None:
        super().__init__()
        self._available = available

    @property
    def device_type(self) -> str:
        return "xpu"

    @property
    def backend(self) -> str:
        return "xccl"

    def is_available(self) -> bool:
        return self._available


class _FakeRegistry:
    """Serves 'cpu' and, when given, 'xpu'; counts lookups."""

    def __init__(self, xpu: _FakeXpu | None) -> None:
        self.cpu = CpuDeviceHandle()
        self.xpu = xpu
        self.lookups: list[str] = []

    def device_handle(self, device_type: str) -> object:
        self.lookups.append(device_type)
        if device_type == "cpu":
            return self.cpu
        if device_type == "xpu" and self.xpu is not None:
            return self.xpu
        raise UnknownPluginNameError(f"no shard plugin serves device type {device_type!r}")


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    plumbing.clear_device_handle_cache()
    yield
    plumbing.clear_device_handle_cache()


def _use(monkeypatch: pytest.MonkeyPatch, registry: _FakeRegistry, accelerator: str | None) -> None:
    monkeypatch.setattr(_device, "get_registry", lambda: registry)
    monkeypatch.setattr(_device, "current_accelerator_type", lambda: accelerator)


def test_without_accelerator_the_cpu_handle_is_used() -> None:
    """On this CPU-only build the default handle is the built-in CPU one, backend gloo."""
    handle = sc.get_device_handle()
    assert (handle.device_type, handle.backend) == ("cpu", "gloo")
    assert sc.get_device_handle("cpu:0") is sc.get_device_handle("cpu")


def test_a_usable_handled_accelerator_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """When torch reports an accelerator a plugin serves and can use, its handle is the default."""
    registry = _FakeRegistry(_FakeXpu(available=True))
    _use(monkeypatch, registry, "xpu")
    assert sc.get_device_handle() is registry.xpu


@pytest.mark.parametrize("xpu", [None, _FakeXpu(available=False)])
def test_unhandled_or_unusable_accelerator_falls_back_to_cpu(
    monkeypatch: pytest.MonkeyPatch, xpu: _FakeXpu | None
) -> None:
    """An accelerator no plugin serves, or whose handle is unusable, leaves the CPU handle."""
    registry = _FakeRegistry(xpu)
    _use(monkeypatch, registry, "xpu")
    assert sc.get_device_handle() is registry.cpu
    assert registry.lookups == ["xpu", "cpu"]


def test_handles_are_cached_until_cleared(monkeypatch: pytest.MonkeyPatch) -> None:
    """Repeated lookups hit the registry once per device type until the cache is cleared."""
    registry = _FakeRegistry(_FakeXpu(available=True))
    _use(monkeypatch, registry, None)
    for _ in range(3):
        sc.get_device_handle("xpu:1")
        sc.get_device_handle()
    assert registry.lookups == ["xpu", "cpu"]
    plumbing.clear_device_handle_cache()
    sc.get_device_handle("xpu")
    assert registry.lookups == ["xpu", "cpu", "xpu"]


def test_unknown_device_type_says_what_to_install() -> None:
    """Asking for a device type no plugin serves raises the registry's error naming the fix."""
    with pytest.raises(
        UnknownPluginNameError, match=re.escape("no shard plugin serves device type 'hpu'")
    ):
        sc.get_device_handle("hpu")
