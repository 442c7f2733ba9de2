"""The CUDA device handle on a machine without CUDA: hook answers, errors, wrappers, statistics."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import shard_core.errors
import shard_device_cuda
from shard_core.errors import ShardError
from shard_core.plugin import Registry, make_plugin_manager
from shard_core.protocols import DeviceHandle, EventLike, StreamLike
from shard_device_cuda import (
    CudaDeviceHandle,
    CudaEvent,
    CudaStream,
    DeviceMismatchError,
    DeviceUnavailableError,
    plugin,
)

without_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the behaviour where CUDA is absent"
)

TORCH = re.escape(torch.__version__)
NO_CUDA = (
    rf"this torch build \({TORCH}\) has no CUDA support; install a CUDA build of torch, "
    r"or use device type 'cpu'$"
)


class RawRecorder:
    """Stands in for a torch.cuda stream or event and records what it was called with."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[tuple[str, Any]] = []

    def __repr__(self) -> str:
        return self.name

    def __getattr__(self, method: str) -> Any:
        def record(*args: Any) -> bool:
            self.calls.append((method, args))
            return True

        return record


def test_hook_answers_cuda_only() -> None:
    """The plugin answers 'cuda' with its handle even without CUDA, and None for other types."""
    for other in ("cpu", "xpu", "mps", "meta"):
        assert plugin.shard_device_handle(other) is None
    assert plugin.shard_device_handle("cuda") is plugin.CUDA_HANDLE


def test_registry_resolves_cuda_to_this_handle_and_leaves_cpu_built_in() -> None:
    """Registered in memory, the plugin serves 'cuda' and the built-in handle still serves 'cpu'."""
    pm = make_plugin_manager(load_entry_points=False)
    pm.register(plugin, name="cuda")
    registry = Registry(pm)
    assert registry.device_handle("cuda") is plugin.CUDA_HANDLE
    assert registry.device_handle("cpu").device_type == "cpu"
    assert not isinstance(registry.device_handle("cpu"), CudaDeviceHandle)


def test_handle_satisfies_the_device_handle_protocol() -> None:
    """The handle is a DeviceHandle with device type 'cuda' and backend 'nccl'."""
    handle = CudaDeviceHandle()
    assert isinstance(handle, DeviceHandle)
    assert (handle.device_type, handle.backend) == ("cuda", "nccl")


def test_wrappers_satisfy_the_stream_and_event_protocols() -> None:
    """CudaStream is StreamLike and CudaEvent is EventLike (class check, no CUDA needed)."""
    assert isinstance(CudaStream(RawRecorder("s")), StreamLike)  # type: ignore[arg-type]
    assert isinstance(CudaEvent(RawRecorder("e")), EventLike)  # type: ignore[arg-type]
    assert not isinstance(CudaStream(RawRecorder("s")), EventLike)  # type: ignore[arg-type]


@without_cuda
def test_without_cuda_the_handle_says_unavailable() -> None:
    """is_available is False and device_count 0, without raising."""
    handle = CudaDeviceHandle()
    assert handle.is_available() is False
    assert handle.device_count() == 0


@without_cuda
@pytest.mark.parametrize(
    ("call", "action"),
    [
        (lambda h: h.new_stream(priority=-1), "create a stream"),
        (lambda h: h.current_stream(), "get the current stream"),
        (lambda h: h.new_event(), "create an event"),
        (lambda h: h.current_device(), "find the current device"),
        (lambda h: h.set_device(0), "set device 0"),
        (lambda h: h.synchronize(), "synchronize"),
        (lambda h: h.memory_stats(), "read memory statistics"),
        (lambda h: h.reset_peak_memory_stats(), "reset peak memory statistics"),
    ],
)
def test_device_work_without_cuda_raises_a_clear_error(call: Any, action: str) -> None:
    """Each method that needs a GPU raises DeviceUnavailableError saying what and why."""
    with pytest.raises(DeviceUnavailableError, match=rf"^cuda: cannot {action}: {NO_CUDA}"):
        call(CudaDeviceHandle())


@without_cuda
def test_unavailable_error_names_visibility_when_torch_has_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a CUDA build but no visible GPU, the message points at the driver and device list."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(
        DeviceUnavailableError,
        match=rf"^cuda: cannot create an event: no CUDA device is visible \(torch "
        rf"{TORCH}, CUDA 12\.8\); check the driver and CUDA_VISIBLE_DEVICES, "
        r"or use device type 'cpu'$",
    ):
        CudaDeviceHandle().new_event()


def test_errors_are_the_shard_core_errors() -> None:
    """The exported errors are shard_core's classes, so one except clause serves every plugin."""
    assert DeviceUnavailableError is shard_core.errors.DeviceUnavailableError
    assert DeviceMismatchError is shard_core.errors.DeviceMismatchError
    assert issubclass(DeviceUnavailableError, ShardError)
    assert issubclass(DeviceMismatchError, ShardError)


def test_set_device_refuses_another_device_type() -> None:
    """set_device(torch.device('cpu')) is a DeviceMismatchError naming the device."""
    with pytest.raises(
        DeviceMismatchError,
        match=r"^cuda: cannot set device cpu: it is not a CUDA device; "
        r"pass torch.device\('cuda', index\) or an index$",
    ):
        CudaDeviceHandle().set_device(torch.device("cpu"))


def test_set_device_checks_the_index_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """An index past the visible devices names the count; a valid one reaches torch.cuda."""
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    handle = CudaDeviceHandle()
    with pytest.raises(
        DeviceMismatchError,
        match=r"^cuda: device index 2 is out of range: this process sees 2 CUDA device\(s\), "
        r"indices 0 to 1; check LOCAL_RANK and CUDA_VISIBLE_DEVICES$",
    ):
        handle.set_device(2)
    handle.set_device(torch.device("cuda", 1))
    handle.set_device(torch.device("cuda"))
    assert chosen == [1]


def test_record_stream_refuses_a_cpu_tensor() -> None:
    """record_stream on a CPU tensor is a DeviceMismatchError naming the tensor's device."""
    with pytest.raises(
        DeviceMismatchError,
        match=r"^cuda: cannot record a stream on a tensor on cpu; "
        r"record_stream applies to CUDA tensors only$",
    ):
        CudaDeviceHandle().record_stream(torch.zeros(1), CudaStream(RawRecorder("s")))  # type: ignore[arg-type]


def test_stream_context_refuses_a_foreign_stream() -> None:
    """Making a non-CUDA stream current names the stream and where to get a CUDA one."""
    with (
        pytest.raises(
            DeviceMismatchError,
            match=r"^cuda: torch.Stream device_type=cpu, device_index=-1, stream_id=0 "
            r"\(Stream\) is not a CUDA stream; use a stream from the CUDA device handle "
            r"\(new_stream, current_stream\)$",
        ),
        CudaDeviceHandle().stream(torch.Stream(device="cpu")),  # type: ignore[arg-type]
    ):
        pass


def test_stream_wrapper_unwraps_what_it_forwards() -> None:
    """CudaStream hands torch the raw streams and events behind the wrappers it is given."""
    a, b, e = RawRecorder("a"), RawRecorder("b"), RawRecorder("e")
    stream = CudaStream(a)  # type: ignore[arg-type]
    event = CudaEvent(e)  # type: ignore[arg-type]
    stream.wait_stream(CudaStream(b))  # type: ignore[arg-type]
    stream.wait_event(event)
    assert stream.record_event(event) is event
    stream.synchronize()
    assert a.calls == [("wait_stream", (b,)), ("wait_event", (e,)), ("synchronize", ())]
    assert e.calls == [("record", (a,))]


def test_event_wrapper_unwraps_streams_and_passes_none_through() -> None:
    """CudaEvent records and waits on the raw stream, or on None for the current stream."""
    s, e = RawRecorder("s"), RawRecorder("e")
    event = CudaEvent(e)  # type: ignore[arg-type]
    event.record()
    event.record(CudaStream(s))  # type: ignore[arg-type]
    event.wait(CudaStream(s))  # type: ignore[arg-type]
    event.wait()
    assert event.query() is True
    event.synchronize()
    assert e.calls == [
        ("record", (None,)),
        ("record", (s,)),
        ("wait", (s,)),
        ("wait", (None,)),
        ("query", ()),
        ("synchronize", ()),
    ]


def test_wrappers_refuse_foreign_events() -> None:
    """Waiting on an event that is neither ours nor torch.cuda's names it."""
    with pytest.raises(
        DeviceMismatchError,
        match=r"^cuda: 'not an event' \(str\) is not a CUDA event; use an event from the "
        r"CUDA device handle \(new_event, record_event\)$",
    ):
        CudaStream(RawRecorder("s")).wait_event("not an event")  # type: ignore[arg-type]


def test_stream_wrappers_compare_by_the_raw_stream() -> None:
    """Two wrappers of one raw stream are equal and hash alike; of two raw streams, not."""
    a, b = RawRecorder("a"), RawRecorder("b")
    assert CudaStream(a) == CudaStream(a)  # type: ignore[arg-type]
    assert hash(CudaStream(a)) == hash(CudaStream(a))  # type: ignore[arg-type]
    assert CudaStream(a) != CudaStream(b)  # type: ignore[arg-type]


def test_memory_stats_translate_the_allocator_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """memory_stats maps torch.cuda.memory_stats keys to ours, missing keys as 0."""
    raw = {
        "allocated_bytes.all.current": 1024,
        "allocated_bytes.all.peak": 4096,
        "reserved_bytes.all.current": 8192,
        "reserved_bytes.all.peak": 16384,
        "active_bytes.all.current": 2048,
        "num_ooms": 1,
        "segment.all.current": 3,
    }
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: raw)
    assert CudaDeviceHandle().memory_stats() == {
        "allocated": 1024,
        "peak_allocated": 4096,
        "reserved": 8192,
        "peak_reserved": 16384,
        "active": 2048,
        "peak_active": 0,
        "num_alloc_retries": 0,
        "num_ooms": 1,
    }


def test_public_surface() -> None:
    """The package exports exactly the handle, its wrappers, errors, stat keys and version."""
    assert shard_device_cuda.__all__ == [
        "CudaDeviceHandle",
        "CudaEvent",
        "CudaStream",
        "DeviceMismatchError",
        "DeviceUnavailableError",
        "MEMORY_STAT_KEYS",
        "__version__",
    ]
