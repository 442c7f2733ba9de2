"""Giving the heap memory the C allocator keeps after frees back to the OS: an opt-in knob.

[Note: host memory the allocator keeps]
On Linux with glibc, CPU tensors live on the C heap, and glibc keeps most of
what a training step frees (activations, gathered parameters, gradients in
flight) resident for the next step rather than returning it: reusing those
pages is cheaper than faulting fresh ones in. That kept memory is what
separates two FSDP implementations holding the same tensors (on the standing
CPU benchmark, 110-160 MiB of a 500-560 MiB peak per rank; see
``tools/bench/README.md``, "memory_profile.py"), and it counts against a
host's memory limit like any other: a CPU training job, or a GPU job whose
parameters, gradients or optimizer state are offloaded to the host.

:func:`release_host_memory` hands it back once (glibc's ``malloc_trim(0)``:
every free page, not only the heap's top). With
:func:`set_release_host_memory_after_backward`, shard does so at the end of
every backward of every root unit, when the step's activations and gathered
parameters have just been freed. The price is the page faults the next
step takes to get the memory back, and a step fragments the heap anew as it
runs, so less comes back than was free: measured on the standing benchmark,
peak RSS per rank 0.93-0.98x PyTorch's for 1.06-1.12x its step time (shard
without it: 1.01-1.05x and 0.92-0.96x). It is off by default, and a no-op
where the C library has no ``malloc_trim`` (musl, macOS, Windows).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

__all__ = [
    "release_host_memory",
    "releases_after_backward",
    "set_release_host_memory_after_backward",
]

_ENABLED = [False]


def _find_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None)
    except OSError:  # no C library symbols reachable from this process (Windows)
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


_MALLOC_TRIM = _find_malloc_trim()


def _resident_bytes() -> int:
    """This process's resident set size, or 0 where ``/proc`` does not say."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_host_memory() -> int:
    """Return the heap memory the C allocator keeps from earlier frees to the OS, now.

    No tensor is touched: only pages no allocation uses are given back. See
    [Note: host memory the allocator keeps] for when this pays.

    Returns:
        How many bytes this process's resident set shrank by (0 where the C
        library cannot release memory, or where ``/proc`` is missing).
    """
    if _MALLOC_TRIM is None:
        return 0
    before = _resident_bytes()
    _MALLOC_TRIM(0)
    return max(before - _resident_bytes(), 0)


def set_release_host_memory_after_backward(enabled: bool) -> None:
    """Have shard call :func:`release_host_memory` at the end of every backward, or stop.

    Process-wide (the heap is): it applies to every ``fully_shard`` and
    ``FullyShardedDataParallel`` root in this process, already built or not.
    Lowers peak host memory at the cost of a slower step; see
    [Note: host memory the allocator keeps].

    Raises:
        TypeError: ``enabled`` is not a bool.
    """
    if not isinstance(enabled, bool):
        raise TypeError(
            "set_release_host_memory_after_backward(enabled) takes a bool, "
            f"got {type(enabled).__name__} {enabled!r}"
        )
    _ENABLED[0] = enabled


def releases_after_backward() -> bool:
    """Whether shard releases host memory at the end of every backward (off by default)."""
    return _ENABLED[0]
