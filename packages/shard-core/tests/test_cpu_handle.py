"""The built-in CPU device handle: protocol conformance, no-op streams, memory statistics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shard_core import CpuDeviceHandle
from shard_core import _cpu as cpu_module
from shard_core.errors import DeviceMismatchError
from shard_core.protocols import DeviceHandle, EventLike, StreamLike

MIB = 1 << 20


def test_cpu_handle_satisfies_device_handle_protocol() -> None:
    """The handle, its streams and its events satisfy the protocols the engine codes against."""
    handle = CpuDeviceHandle()
    stream = handle.new_stream(priority=-1)
    assert isinstance(handle, DeviceHandle)
    assert isinstance(stream, StreamLike)
    assert isinstance(handle.current_stream(), StreamLike)
    assert isinstance(handle.new_event(), EventLike)
    assert isinstance(stream.record_event(), EventLike)


def test_cpu_handle_describes_one_gloo_cpu_device() -> None:
    """CPU is one device, always available, communicating through gloo."""
    handle = CpuDeviceHandle()
    assert (handle.device_type, handle.backend) == ("cpu", "gloo")
    assert handle.is_available() is True
    assert handle.device_count() == 1
    assert handle.current_device() == torch.device("cpu")


def test_cpu_handle_set_device_accepts_cpu_and_indices() -> None:
    """set_device is a no-op for CPU devices and any index, so launch code can call it per rank."""
    handle = CpuDeviceHandle()
    handle.set_device(torch.device("cpu"))
    handle.set_device(3)
    assert handle.current_device() == torch.device("cpu")


def test_cpu_handle_set_device_rejects_other_device_types() -> None:
    """Making a CUDA device current is a DeviceMismatchError naming the device type to resolve."""
    with pytest.raises(
        DeviceMismatchError,
        match=r"^the CPU device handle cannot make cuda:1 current; "
        r"resolve the handle for device type 'cuda' instead$",
    ):
        CpuDeviceHandle().set_device(torch.device("cuda", 1))


def test_cpu_streams_and_events_are_complete_no_ops() -> None:
    """Ordering calls do nothing, events report completion, and stream() is a context manager."""
    handle = CpuDeviceHandle()
    stream = handle.new_stream()
    event = handle.new_event()
    event.record(stream)
    event.wait()
    stream.wait_stream(handle.current_stream())
    stream.wait_event(event)
    stream.synchronize()
    event.synchronize()
    handle.record_stream(torch.zeros(2), stream)
    handle.synchronize()
    with handle.stream(stream) as entered:
        assert entered is None
    assert event.query() is True
    assert stream.record_event(event) is event
    assert handle.current_stream() is handle.current_stream()


def test_cpu_memory_stats_track_a_large_allocation() -> None:
    """allocated grows by a 64 MiB tensor while it lives, and peak_allocated keeps it after."""
    handle = CpuDeviceHandle()
    handle.reset_peak_memory_stats()
    before = handle.memory_stats()
    block = torch.ones(64 * MIB // 4)
    during = handle.memory_stats()
    del block
    after = handle.memory_stats()
    assert set(before) == {"allocated", "peak_allocated"}
    assert during["allocated"] - before["allocated"] >= 60 * MIB
    assert after["peak_allocated"] >= during["allocated"]
    assert before["peak_allocated"] >= before["allocated"] > 0


def test_cpu_reset_peak_memory_stats_forgets_a_freed_allocation() -> None:
    """After a reset the peak no longer includes a freed 64 MiB block (Linux clear_refs)."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs /proc/self/clear_refs (Linux)")
    handle = CpuDeviceHandle()
    block = torch.ones(64 * MIB // 4)
    peak_with_block = handle.memory_stats()["peak_allocated"]
    del block
    handle.reset_peak_memory_stats()
    stats = handle.memory_stats()
    assert stats["peak_allocated"] <= peak_with_block - 60 * MIB
    assert stats["peak_allocated"] >= stats["allocated"]


def test_cpu_os_peak_reads_vmhwm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """On Linux the peak is VmHWM (KiB in /proc/self/status), reported in bytes."""
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmPeak:\t  900 kB\nVmHWM:\t    300 kB\nVmRSS:\t 200 kB\n")
    monkeypatch.setattr(cpu_module, "_STATUS", status)
    assert cpu_module._os_peak_rss() == 300 * 1024


def test_cpu_os_peak_converts_maxrss_units(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without /proc, ru_maxrss is KiB on Linux and bytes on macOS; the peak is in bytes."""
    resource = pytest.importorskip("resource")
    monkeypatch.setattr(cpu_module, "_STATUS", tmp_path / "missing")

    class Usage:
        ru_maxrss = 2048

    monkeypatch.setattr(resource, "getrusage", lambda who: Usage())
    monkeypatch.setattr(cpu_module.sys, "platform", "linux")
    assert cpu_module._os_peak_rss() == 2048 * 1024
    monkeypatch.setattr(cpu_module.sys, "platform", "darwin")
    assert cpu_module._os_peak_rss() == 2048


def test_cpu_current_rss_parses_statm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The second field of statm is resident pages, converted with the page size."""
    statm = tmp_path / "statm"
    statm.write_text("1000 300 20 5 0 100 0\n")
    monkeypatch.setattr(cpu_module, "_STATM", statm)
    monkeypatch.setattr(cpu_module, "_page_size", lambda: 4096)
    assert cpu_module._current_rss() == 300 * 4096
    monkeypatch.setattr(cpu_module, "_STATM", tmp_path / "missing")
    assert cpu_module._current_rss() is None


def test_cpu_peak_falls_back_to_a_baseline_without_clear_refs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without clear_refs, the peak after a reset is the highest sample until the OS peak moves."""
    readings = {"current": 500, "os_peak": 900}
    monkeypatch.setattr(cpu_module, "_current_rss", lambda: readings["current"])
    monkeypatch.setattr(cpu_module, "_os_peak_rss", lambda: readings["os_peak"])
    monkeypatch.setattr(cpu_module, "_clear_os_peak", lambda: False)
    handle = CpuDeviceHandle()
    assert handle.memory_stats() == {"allocated": 500, "peak_allocated": 900}
    handle.reset_peak_memory_stats()
    assert handle.memory_stats() == {"allocated": 500, "peak_allocated": 500}
    readings["current"] = 700
    assert handle.memory_stats() == {"allocated": 700, "peak_allocated": 700}
    readings["current"] = 600
    assert handle.memory_stats() == {"allocated": 600, "peak_allocated": 700}
    readings.update(current=650, os_peak=1200)
    assert handle.memory_stats() == {"allocated": 650, "peak_allocated": 1200}


def test_cpu_memory_stats_without_any_os_support(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the OS reports neither size (Windows), both statistics are 0."""
    monkeypatch.setattr(cpu_module, "_current_rss", lambda: None)
    monkeypatch.setattr(cpu_module, "_os_peak_rss", lambda: None)
    assert CpuDeviceHandle().memory_stats() == {"allocated": 0, "peak_allocated": 0}
