"""Honest peak-memory measurements of one call, for memory tests.

A test measures the growth of this process's peak resident set size
(``VmHWM``) during one call. So that the allocator cannot hide an allocation
in memory it kept from earlier frees, :meth:`PeakMeter.start` returns freed
heap memory to the OS and makes allocations of 1 MiB or more use ``mmap``
(given back on free). ``/proc/self/status`` is read rather than
``getrusage``: writing "5" to ``/proc/self/clear_refs`` resets ``VmHWM``, but
``ru_maxrss`` also keeps the peak of threads that have exited.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from pathlib import Path

__all__ = ["MIB", "PeakMeter", "can_measure_peak"]

MIB = 2**20

_LIBC = ctypes.util.find_library("c")
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def can_measure_peak() -> bool:
    """Whether this machine has what :class:`PeakMeter` needs (Linux, glibc)."""
    return (
        _LIBC is not None
        and hasattr(ctypes.CDLL(_LIBC), "malloc_trim")
        and os.access(_CLEAR_REFS, os.W_OK)
    )


class PeakMeter:
    """Growth of this process's peak resident set size since :meth:`start`."""

    def __init__(self) -> None:
        self._baseline = 0

    def start(self) -> None:
        gc.collect()
        assert _LIBC is not None
        libc = ctypes.CDLL(_LIBC)
        assert libc.mallopt(_M_MMAP_THRESHOLD, MIB) == 1
        libc.malloc_trim(0)
        _CLEAR_REFS.write_text("5")
        self._baseline = _status_bytes("VmRSS")

    def growth(self) -> int:
        return _status_bytes("VmHWM") - self._baseline


def _status_bytes(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024  # kB
    raise AssertionError(f"no {field} in {_STATUS}")
