"""The built-in CPU device handle.

The engine is written once against :class:`~shard_core.protocols.DeviceHandle`
and runs unchanged on CPU, where gloo does the communication and there are no
streams to overlap: every stream and event here is a no-op that reports its
work as done, so ordering code (record, wait, synchronize) costs nothing.
Memory statistics are the process's resident set size, which is what a CPU
run has to fit in.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from shard_core.errors import DeviceMismatchError
from shard_core.protocols import EventLike, StreamLike

__all__ = ["CpuDeviceHandle"]

# [Note: CPU peak memory]
# ``peak_allocated`` is the process's peak resident set size (``VmHWM`` on
# Linux; elsewhere ``ru_maxrss``, bytes on macOS). Linux resets that peak when "5" is written to
# /proc/self/clear_refs, which is what ``reset_peak_memory_stats`` does. Where
# that file is missing or not writable (macOS, locked-down containers), the
# handle keeps a baseline instead: the OS peak at the reset. While the OS peak
# stays at or below it, the peak since the reset is not known exactly, and the
# handle reports the highest resident size it sampled since the reset (at the
# reset and at each ``memory_stats`` call); once the OS peak exceeds the
# baseline, that new peak is exact and is reported. Either way the peak is
# never below a resident size sampled since the reset: the kernel updates its
# peak lazily, so it can trail the current size by a few pages.

_STATM = Path("/proc/self/statm")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _page_size() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows)
        return 4096


_STATUS = Path("/proc/self/status")


def _os_peak_rss() -> int | None:
    """Peak resident set size of this process in bytes, or ``None`` where unknown.

    Linux: ``VmHWM`` from /proc/self/status, which clear_refs resets;
    ``ru_maxrss`` is not reset by it once a thread of the process has exited.
    """
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # Windows
        return None
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max_rss if sys.platform == "darwin" else max_rss * 1024


def _current_rss() -> int | None:
    """Current resident set size of this process in bytes, or ``None`` where unknown."""
    try:
        fields = _STATM.read_text().split()
    except OSError:
        return None
    return int(fields[1]) * _page_size()


def _clear_os_peak() -> bool:
    """Reset the OS's peak resident set size; whether that worked."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


class _CpuEvent:
    """An event on CPU: work is synchronous, so it has always completed."""

    __slots__ = ()

    def record(self, stream: StreamLike | None = None) -> None:
        pass

    def wait(self, stream: StreamLike | None = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return "CpuEvent()"


class _CpuStream:
    """A stream on CPU: work runs on the host in program order, so ordering is free."""

    __slots__ = ("priority",)

    def __init__(self, priority: int = 0) -> None:
        self.priority = priority

    def wait_stream(self, stream: StreamLike) -> None:
        pass

    def wait_event(self, event: EventLike) -> None:
        pass

    def record_event(self, event: EventLike | None = None) -> EventLike:
        if event is None:
            event = _CpuEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"CpuStream(priority={self.priority})"


class CpuDeviceHandle:
    """The :class:`~shard_core.protocols.DeviceHandle` for ``"cpu"``, built into shard-core.

    One device, always available, communication through gloo; streams and
    events are no-ops; memory statistics are the process's resident set size
    in bytes. See [Note: CPU peak memory] in this module for how the peak is
    reset.
    """

    def __init__(self) -> None:
        self._default_stream = _CpuStream()
        # - peak fallback, used only when the OS peak cannot be reset
        self._baseline: int | None = None  # OS peak at the last reset
        self._sampled_peak = 0  # highest current RSS seen since that reset

    def __repr__(self) -> str:
        return "CpuDeviceHandle()"

    @property
    def device_type(self) -> str:
        return "cpu"

    @property
    def backend(self) -> str:
        return "gloo"

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def set_device(self, device: torch.device | int) -> None:
        """Accept any CPU device or index (a no-op), so launch code can call it on every rank."""
        if isinstance(device, torch.device) and device.type != "cpu":
            raise DeviceMismatchError(
                f"the CPU device handle cannot make {device} current; "
                f"resolve the handle for device type {device.type!r} instead"
            )

    def new_stream(self, priority: int = 0) -> StreamLike:
        return _CpuStream(priority)

    def current_stream(self) -> StreamLike:
        return self._default_stream

    def stream(self, stream: StreamLike) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def new_event(self) -> EventLike:
        return _CpuEvent()

    def record_stream(self, tensor: torch.Tensor, stream: StreamLike) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def memory_stats(self) -> Mapping[str, int]:
        """Resident set size in bytes: ``allocated`` now, ``peak_allocated`` since the last reset.

        Where the OS does not report the current size
        (no ``/proc``), ``allocated`` is the peak; where it reports neither
        (Windows), both are 0.
        """
        os_peak = _os_peak_rss()
        current = _current_rss()
        if current is None:
            current = os_peak if os_peak is not None else 0
        if os_peak is None:
            os_peak = current
        self._sampled_peak = max(self._sampled_peak, current)
        # See [Note: CPU peak memory]
        exact = self._baseline is None or os_peak > self._baseline
        peak = max(os_peak if exact else 0, self._sampled_peak)
        return {"allocated": current, "peak_allocated": peak}

    def reset_peak_memory_stats(self) -> None:
        """Start a new peak measurement (see [Note: CPU peak memory])."""
        current = _current_rss()
        self._sampled_peak = current if current is not None else 0
        if _clear_os_peak():
            self._baseline = None
        else:
            self._baseline = _os_peak_rss()
