"""A small cache of staging buffers for the collectives.

Collectives need scratch space: a flat buffer to copy several tensors into
before one collective, a buffer in the reduce dtype when the gradient is in
another. Allocating it on every call is what makes a step slow (copying into
an existing 64 MiB buffer is several times faster than into a fresh one; see
``tools/bench/README.md``), so buffers are kept and handed out again.

[Note: Buffer cache]
- Buffers are keyed by (bucket, dtype, device); the bucket is the element
  count rounded up to a power of two, so units of similar size share one
  buffer and callers take a ``[:numel]`` view of it.
- A buffer is leased: :meth:`BufferCache.acquire` takes it out of the cache
  and :meth:`BufferCache.release` puts it back, so two collectives in flight
  at once (async handles) never share one. A lease that is never released is
  simply garbage collected.
- Only CPU buffers are cached. On an accelerator the collectives and copies
  are queued on streams, and a buffer released after one stream's work
  could be handed to another stream while that work is still in flight;
  the caching allocators of those devices already recycle memory per
  stream, so there the cache allocates exactly what is asked and keeps
  nothing. (A fresh CPU allocation of 64 MiB or more is page-faulted in on
  every use, which is the cost the cache removes.)
- The cache keeps at most ``max_bytes`` (``SHARD_COMM_BUFFER_CACHE_MB``
  mebibytes, 1024 by default) of free buffers, evicting the least recently
  used; :func:`clear_buffer_cache` empties it (before a memory measurement,
  say).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from shard_core.errors import CommError

__all__ = [
    "BufferCache",
    "BufferCacheInfo",
    "buffer_cache",
    "buffer_cache_info",
    "clear_buffer_cache",
]

_MIN_BUCKET = 1024
# Device types whose buffers are cached. See [Note: Buffer cache]
_CACHED_DEVICE_TYPES = frozenset({"cpu"})
_DEFAULT_MAX_MB = 1024


@dataclass(frozen=True, slots=True)
class BufferCacheInfo:
    """What the staging-buffer cache holds now.

    Attributes:
        buffers: Number of free buffers kept.
        bytes: Their total size in bytes.
        max_bytes: The most the cache keeps before evicting.
        hits: Acquisitions served from the cache since the last clear.
        misses: Acquisitions that allocated since the last clear.
    """

    buffers: int
    bytes: int
    max_bytes: int
    hits: int
    misses: int


def _bucket(numel: int) -> int:
    if numel <= _MIN_BUCKET:
        return _MIN_BUCKET
    return 1 << (numel - 1).bit_length()


class BufferCache:
    """Staging buffers by (bucket, dtype, device), leased and returned.

    See [Note: Buffer cache].
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: OrderedDict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = (
            OrderedDict()
        )
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of at least ``numel`` elements, leased to the caller until released."""
        if device.type not in _CACHED_DEVICE_TYPES:
            return torch.empty(numel, dtype=dtype, device=device)
        key = (_bucket(numel), dtype, device)
        with self._lock:
            free = self._free.get(key)
            if free:
                buffer = free.pop()
                if not free:
                    del self._free[key]
                self._bytes -= buffer.numel() * buffer.element_size()
                self._hits += 1
                return buffer
            self._misses += 1
        return torch.empty(key[0], dtype=dtype, device=device)

    def release(self, buffer: torch.Tensor) -> None:
        """Give a buffer from :meth:`acquire` back for reuse."""
        nbytes = buffer.numel() * buffer.element_size()
        if nbytes > self.max_bytes or buffer.device.type not in _CACHED_DEVICE_TYPES:
            return
        key = (buffer.numel(), buffer.dtype, buffer.device)
        with self._lock:
            self._free.setdefault(key, []).append(buffer)
            self._free.move_to_end(key)
            self._bytes += nbytes
            while self._bytes > self.max_bytes:
                _, oldest = next(iter(self._free.items()))
                evicted = oldest.pop(0)
                if not oldest:
                    self._free.popitem(last=False)
                self._bytes -= evicted.numel() * evicted.element_size()

    def clear(self) -> None:
        """Drop every free buffer and reset the hit and miss counts."""
        with self._lock:
            self._free.clear()
            self._bytes = 0
            self._hits = 0
            self._misses = 0

    def info(self) -> BufferCacheInfo:
        """What the cache holds now."""
        with self._lock:
            return BufferCacheInfo(
                buffers=sum(len(free) for free in self._free.values()),
                bytes=self._bytes,
                max_bytes=self.max_bytes,
                hits=self._hits,
                misses=self._misses,
            )


def _max_bytes_from_env() -> int:
    raw = os.environ.get("SHARD_COMM_BUFFER_CACHE_MB", "")
    if not raw:
        return _DEFAULT_MAX_MB << 20
    try:
        mebibytes = int(raw)
    except ValueError:
        raise CommError(
            f"SHARD_COMM_BUFFER_CACHE_MB={raw!r} is not an integer; set it to the "
            "number of mebibytes the staging-buffer cache may keep (0 disables it)"
        ) from None
    return max(mebibytes, 0) << 20


_CACHE: BufferCache | None = None


def buffer_cache() -> BufferCache:
    """The process-wide staging-buffer cache the collectives use."""
    global _CACHE
    if _CACHE is None:
        _CACHE = BufferCache(_max_bytes_from_env())
    return _CACHE


def clear_buffer_cache() -> None:
    """Free every cached staging buffer (see [Note: Buffer cache])."""
    buffer_cache().clear()


def buffer_cache_info() -> BufferCacheInfo:
    """What the staging-buffer cache holds now."""
    return buffer_cache().info()
