"""Accelerator handles through torch.accelerator, simulated on a CPU machine by monkeypatching."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import shard_core.errors
import shard_device_accel
from shard_core.errors import ShardError
from shard_core.plugin import Registry, make_plugin_manager
from shard_core.protocols import DeviceHandle, EventLike, StreamLike
from shard_device_accel import (
    ACCELERATOR_TYPES,
    AcceleratorDeviceHandle,
    AcceleratorEvent,
    AcceleratorStream,
    DeviceMismatchError,
    DeviceUnavailableError,
    accelerator_handle,
    plugin,
)

_CURRENT = torch.accelerator.current_accelerator()
without_served_accelerator = pytest.mark.skipif(
    _CURRENT is not None and _CURRENT.type in ACCELERATOR_TYPES,
    reason="checks the answers where no xpu, hpu, npu or mps is present",
)


class FakeStream:
    """Stands in for torch.Stream on a simulated device and records its calls."""

    def __init__(self, device: torch.device | str = "xpu", priority: int = 0) -> None:
        self.device = torch.device(device)
        self.priority = priority
        self.calls: list[tuple[str, Any]] = []

    def __repr__(self) -> str:
        return f"FakeStream({self.device}, priority={self.priority})"

    def wait_stream(self, other: Any) -> None:
        self.calls.append(("wait_stream", other))

    def wait_event(self, event: Any) -> None:
        self.calls.append(("wait_event", event))

    def record_event(self) -> FakeEvent:
        event = FakeEvent(self.device)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.calls.append(("synchronize", None))

    def __enter__(self) -> None:
        self.calls.append(("enter", None))

    def __exit__(self, *exc: object) -> None:
        self.calls.append(("exit", None))


class FakeEvent:
    """Stands in for torch.Event on a simulated device and records its calls."""

    def __init__(self, device: torch.device | str = "xpu") -> None:
        self.device = torch.device(device)
        self.calls: list[tuple[str, Any]] = []

    def record(self, stream: Any = None) -> None:
        self.calls.append(("record", stream))

    def wait(self, stream: Any = None) -> None:
        self.calls.append(("wait", stream))

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.calls.append(("synchronize", None))


class FakeTensor:
    """A tensor on a simulated device: only its device and record_stream matter here."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.recorded: list[Any] = []

    def record_stream(self, stream: Any) -> None:
        self.recorded.append(stream)


def _simulate(
    monkeypatch: pytest.MonkeyPatch,
    device_type: str | None,
    *,
    available: bool = True,
    count: int = 2,
    index: int = 1,
) -> list[tuple[str, Any]]:
    """Make torch.accelerator report ``device_type``; returns the calls that change state."""
    calls: list[tuple[str, Any]] = []
    # Only .type is read; a namespace also stands for npu, which torch knows only once
    # torch_npu has renamed the privateuse1 backend.
    current = None if device_type is None else SimpleNamespace(type=device_type)
    accel = torch.accelerator
    monkeypatch.setattr(accel, "current_accelerator", lambda check_available=False: current)
    monkeypatch.setattr(accel, "is_available", lambda: available)
    monkeypatch.setattr(accel, "device_count", lambda: count)
    monkeypatch.setattr(accel, "current_device_index", lambda: index)
    monkeypatch.setattr(accel, "set_device_index", lambda i: calls.append(("set_device_index", i)))
    monkeypatch.setattr(accel, "synchronize", lambda: calls.append(("synchronize", None)))
    monkeypatch.setattr(accel, "current_stream", lambda: FakeStream(f"{device_type}:{index}"))
    monkeypatch.setattr(torch, "Stream", FakeStream)
    monkeypatch.setattr(torch, "Event", FakeEvent)
    return calls


def _registry() -> Registry:
    pm = make_plugin_manager(load_entry_points=False)
    pm.register(plugin, name="accel")
    return Registry(pm)


@without_served_accelerator
def test_hook_answers_nothing_without_an_accelerator() -> None:
    """Where no served type is present the hook answers None for every type."""
    for device_type in ("xpu", "hpu", "npu", "mps", "cpu", "cuda", "tpu"):
        assert plugin.shard_device_handle(device_type) is None


def test_hook_answers_the_current_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """With xpu as the current accelerator the hook answers xpu with backend xccl, others None."""
    _simulate(monkeypatch, "xpu")
    handle = plugin.shard_device_handle("xpu")
    assert isinstance(handle, AcceleratorDeviceHandle)
    assert isinstance(handle, DeviceHandle)
    assert (handle.device_type, handle.backend) == ("xpu", "xccl")
    for absent in ("hpu", "npu", "mps", "cpu", "cuda"):
        assert plugin.shard_device_handle(absent) is None


def test_registry_resolves_a_present_type_and_leaves_cpu_built_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Registered in memory, the plugin serves a present xpu and the built-in still serves cpu."""
    _simulate(monkeypatch, "xpu")
    registry = _registry()
    assert isinstance(registry.device_handle("xpu"), AcceleratorDeviceHandle)
    cpu = registry.device_handle("cpu")
    assert cpu.device_type == "cpu"
    assert not isinstance(cpu, AcceleratorDeviceHandle)


@pytest.mark.parametrize(
    ("device_type", "backend"), [("xpu", "xccl"), ("hpu", "hccl"), ("npu", "hccl"), ("mps", "gloo")]
)
def test_each_type_gets_its_backend(
    monkeypatch: pytest.MonkeyPatch, device_type: str, backend: str
) -> None:
    """Each served type maps to its torch.distributed backend."""
    _simulate(monkeypatch, device_type)
    handle = accelerator_handle(device_type)
    assert handle is not None
    assert handle.backend == backend
    assert repr(handle) == f"AcceleratorDeviceHandle({device_type!r})"


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_cpu_and_cuda_are_never_answered(monkeypatch: pytest.MonkeyPatch, device_type: str) -> None:
    """Even when torch.accelerator reports cuda (or cpu), this plugin leaves the type alone."""
    _simulate(monkeypatch, device_type)
    assert accelerator_handle(device_type) is None
    assert sorted(ACCELERATOR_TYPES) == ["hpu", "mps", "npu", "xpu"]


def test_handle_for_a_type_it_does_not_serve_is_refused() -> None:
    """Building a handle for cuda directly names the types served and where cuda comes from."""
    with pytest.raises(
        DeviceMismatchError,
        match=r"^shard-device-accel serves \['hpu', 'mps', 'npu', 'xpu'\], not 'cuda'; cpu is "
        r"built into shard-core and cuda comes from shard-device-cuda$",
    ):
        AcceleratorDeviceHandle("cuda")


def test_type_module_that_reports_available_is_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A type whose torch module says available is answered, but refuses device work."""
    _simulate(monkeypatch, None)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    handle = accelerator_handle("xpu")
    assert handle is not None
    assert handle.is_available() is False
    assert handle.device_count() == 0
    with pytest.raises(
        DeviceUnavailableError,
        match=r"^xpu: cannot create a stream: torch.accelerator drives no accelerator in this "
        r"process, not 'xpu'; shard-device-accel reaches a device only through "
        r"torch.accelerator, so run where xpu is the current accelerator$",
    ):
        handle.new_stream()


def test_compiled_in_but_absent_device_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build for xpu with no device: answered, is_available False, device work says why."""
    _simulate(monkeypatch, "xpu", available=False)
    handle = accelerator_handle("xpu")
    assert handle is not None
    assert handle.is_available() is False
    with pytest.raises(
        DeviceUnavailableError,
        match=r"^xpu: cannot synchronize: torch was built for xpu but no xpu device is usable "
        r"here; check the driver and the device visibility settings, or use device type 'cpu'$",
    ):
        handle.synchronize()


def test_device_queries_and_changes_go_through_torch_accelerator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """current_device, device_count, set_device and synchronize reach torch.accelerator."""
    calls = _simulate(monkeypatch, "xpu", count=2, index=1)
    handle = AcceleratorDeviceHandle("xpu")
    assert handle.is_available() is True
    assert handle.device_count() == 2
    assert handle.current_device() == torch.device("xpu", 1)
    handle.set_device(0)
    handle.set_device(torch.device("xpu", 1))
    handle.set_device(torch.device("xpu"))
    handle.synchronize()
    assert calls == [("set_device_index", 0), ("set_device_index", 1), ("synchronize", None)]


def test_set_device_refuses_other_types_and_out_of_range_indices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """set_device names the wrong device type, or the index range this process sees."""
    _simulate(monkeypatch, "hpu", count=2)
    handle = AcceleratorDeviceHandle("hpu")
    with pytest.raises(
        DeviceMismatchError,
        match=r"^hpu: cannot set device cuda:0: it is not a hpu device; "
        r"pass torch.device\('hpu', index\) or an index$",
    ):
        handle.set_device(torch.device("cuda", 0))
    with pytest.raises(
        DeviceMismatchError,
        match=r"^hpu: device index 3 is out of range: this process sees 2 hpu device\(s\), "
        r"indices 0 to 1; check LOCAL_RANK and the device visibility settings$",
    ):
        handle.set_device(3)


def test_new_stream_is_a_torch_stream_with_priority_on_the_current_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """new_stream builds torch.Stream(device=<type>:<current index>, priority=...) and wraps it."""
    _simulate(monkeypatch, "xpu", index=1)
    stream = AcceleratorDeviceHandle("xpu").new_stream(priority=-1)
    assert isinstance(stream, AcceleratorStream)
    assert isinstance(stream, StreamLike)
    assert isinstance(stream.raw, FakeStream)
    assert (stream.raw.device, stream.raw.priority) == (torch.device("xpu", 1), -1)
    assert stream.device_type == "xpu"


def test_single_queue_type_hands_out_its_current_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """On mps new_stream returns the current stream and record_stream does nothing."""
    _simulate(monkeypatch, "mps", index=0)
    handle = AcceleratorDeviceHandle("mps")
    stream = handle.new_stream(priority=-1)
    assert (stream.raw.device, stream.raw.priority) == (torch.device("mps", 0), 0)
    tensor = FakeTensor("mps")
    handle.record_stream(tensor, stream)  # type: ignore[arg-type]
    assert tensor.recorded == []


def test_record_stream_passes_the_raw_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """record_stream on a multi-stream type hands the tensor the raw torch.Stream."""
    _simulate(monkeypatch, "hpu")
    handle = AcceleratorDeviceHandle("hpu")
    stream = handle.new_stream()
    tensor = FakeTensor("hpu:1")
    handle.record_stream(tensor, stream)  # type: ignore[arg-type]
    assert tensor.recorded == [stream.raw]


def test_record_stream_refuses_a_tensor_of_another_type(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU tensor given to the xpu handle's record_stream names its device."""
    _simulate(monkeypatch, "xpu")
    handle = AcceleratorDeviceHandle("xpu")
    with pytest.raises(
        DeviceMismatchError,
        match=r"^xpu: cannot record a stream on a tensor on cpu; "
        r"record_stream applies to xpu tensors only$",
    ):
        handle.record_stream(torch.zeros(1), handle.new_stream())


def test_stream_context_enters_the_raw_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """handle.stream(s) makes the raw torch.Stream current for the block and restores it after."""
    _simulate(monkeypatch, "xpu")
    handle = AcceleratorDeviceHandle("xpu")
    stream = handle.new_stream()
    with handle.stream(stream):
        assert stream.raw.calls == [("enter", None)]
    assert stream.raw.calls == [("enter", None), ("exit", None)]


def test_stream_of_another_device_type_is_refused() -> None:
    """A real CPU torch.Stream given to the xpu handle is named in the error."""
    handle = AcceleratorDeviceHandle("xpu")
    cpu_stream = torch.Stream(device="cpu")
    with (
        pytest.raises(
            DeviceMismatchError,
            match=rf"^xpu: {re.escape(repr(cpu_stream))} \(Stream\) is not a xpu stream; use a "
            r"stream from the xpu device handle \(new_stream, current_stream\)$",
        ),
        handle.stream(cpu_stream),  # type: ignore[arg-type]
    ):
        pass


def test_stream_and_event_wrappers_unwrap_what_they_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Streams wait on raw streams and events, events record and wait on raw streams."""
    _simulate(monkeypatch, "xpu")
    handle = AcceleratorDeviceHandle("xpu")
    first, second = handle.new_stream(), handle.new_stream()
    event = handle.new_event()
    assert isinstance(event, AcceleratorEvent)
    assert isinstance(event, EventLike)
    first.wait_stream(second)
    first.wait_event(event)
    assert first.record_event(event) is event
    recorded = second.record_event()
    event.record()
    event.wait(second)
    first.synchronize()
    assert event.query() is True
    assert first.raw.calls == [
        ("wait_stream", second.raw),
        ("wait_event", event.raw),
        ("synchronize", None),
    ]
    assert event.raw.calls == [("record", first.raw), ("record", None), ("wait", second.raw)]
    assert recorded.raw.calls == [("record", second.raw)]


def test_event_of_another_device_type_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiting on a cpu event from an xpu stream names the event and where to get one."""
    _simulate(monkeypatch, "xpu")
    stream = AcceleratorDeviceHandle("xpu").new_stream()
    with pytest.raises(
        DeviceMismatchError,
        match=r"^xpu: .* \(AcceleratorEvent\) is not a xpu event; use an event from the xpu "
        r"device handle \(new_event, record_event\)$",
    ):
        stream.wait_event(AcceleratorEvent(FakeEvent("cpu")))  # type: ignore[arg-type]


def test_stream_wrappers_compare_by_the_raw_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two wrappers of one raw stream are equal and hash alike; of two raw streams, not."""
    _simulate(monkeypatch, "xpu")
    raw = FakeStream("xpu:0")
    assert AcceleratorStream(raw) == AcceleratorStream(raw)  # type: ignore[arg-type]
    assert hash(AcceleratorStream(raw)) == hash(AcceleratorStream(raw))  # type: ignore[arg-type]
    assert AcceleratorStream(raw) != AcceleratorStream(FakeStream("xpu:0"))  # type: ignore[arg-type]


def test_memory_stats_translate_the_allocator_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """memory_stats maps torch.accelerator.memory_stats keys to ours, missing keys as 0."""
    _simulate(monkeypatch, "xpu")
    resets: list[None] = []
    raw = {
        "allocated_bytes.all.current": 512,
        "allocated_bytes.all.peak": 2048,
        "reserved_bytes.all.current": 4096,
        "num_alloc_retries": 2,
    }
    monkeypatch.setattr(torch.accelerator, "memory_stats", lambda: raw)
    monkeypatch.setattr(torch.accelerator, "reset_peak_memory_stats", lambda: resets.append(None))
    handle = AcceleratorDeviceHandle("xpu")
    assert handle.memory_stats() == {
        "allocated": 512,
        "peak_allocated": 2048,
        "reserved": 4096,
        "peak_reserved": 0,
        "active": 0,
        "peak_active": 0,
        "num_alloc_retries": 2,
        "num_ooms": 0,
    }
    handle.reset_peak_memory_stats()
    assert resets == [None]


def test_memory_stats_missing_from_torch_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the installed torch lacks torch.accelerator.memory_stats the error names it."""
    _simulate(monkeypatch, "xpu")
    monkeypatch.delattr(torch.accelerator, "memory_stats")
    with pytest.raises(
        DeviceUnavailableError,
        match=rf"^xpu: cannot read memory statistics: torch {re.escape(torch.__version__)} has "
        r"no torch.accelerator.memory_stats; upgrade torch$",
    ):
        AcceleratorDeviceHandle("xpu").memory_stats()


def test_errors_are_the_shard_core_errors() -> None:
    """The exported errors are shard_core's classes, so one except clause serves every plugin."""
    assert DeviceUnavailableError is shard_core.errors.DeviceUnavailableError
    assert DeviceMismatchError is shard_core.errors.DeviceMismatchError
    assert issubclass(DeviceUnavailableError, ShardError)
    assert issubclass(DeviceMismatchError, ShardError)


def test_public_surface() -> None:
    """The package exports exactly its handle, wrappers, tables, errors, factory and version."""
    assert shard_device_accel.__all__ == [
        "ACCELERATOR_TYPES",
        "AcceleratorDeviceHandle",
        "AcceleratorEvent",
        "AcceleratorStream",
        "AcceleratorType",
        "DeviceMismatchError",
        "DeviceUnavailableError",
        "MEMORY_STAT_KEYS",
        "__version__",
        "accelerator_handle",
    ]
