"""Building blocks for device-handle plugins over torch's own device runtime.

A device handle plugin (shard-device-cuda over ``torch.cuda``,
shard-device-accel over ``torch.accelerator``, a third party's) wraps torch
streams and events so that they accept any :class:`~shard_core.protocols.StreamLike`,
checks device indices and tensor devices, and translates allocator
statistics. Those parts do not depend on the device, so they live here once:

- :class:`TorchStream` and :class:`TorchEvent`: the wrappers, with the
  unwrapping (which raw objects count as this device's) left to the plugin;
- :class:`TorchDeviceHandle`: ``set_device``, ``record_stream`` and
  ``memory_stats``, with the device calls left to the plugin;
- :data:`MEMORY_STAT_KEYS`: our statistic names and the caching allocator's.

Public for plugin authors; shard's own code sees only the protocols.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Generic, TypeVar, cast

import torch

from shard_core.errors import DeviceMismatchError
from shard_core.protocols import EventLike, StreamLike

__all__ = ["MEMORY_STAT_KEYS", "TorchDeviceHandle", "TorchEvent", "TorchStream"]

MEMORY_STAT_KEYS: Mapping[str, str] = {
    "allocated": "allocated_bytes.all.current",
    "peak_allocated": "allocated_bytes.all.peak",
    "reserved": "reserved_bytes.all.current",
    "peak_reserved": "reserved_bytes.all.peak",
    "active": "active_bytes.all.current",
    "peak_active": "active_bytes.all.peak",
    "num_alloc_retries": "num_alloc_retries",
    "num_ooms": "num_ooms",
}
"""Our statistic names and the keys torch's caching allocators report them under.

Values are bytes, except the two ``num_`` counts (allocator retries after
freeing its cache, and out-of-memory errors). A key the allocator does not
report reads 0.
"""


class TorchEvent:
    """An ``EventLike`` over one torch event (``raw``).

    Subclasses say which streams are theirs (:meth:`_unwrap_stream`); ``None``
    passes through as "the current stream", as torch's events take it.
    """

    __slots__ = ("raw",)

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.raw!r})"

    def _unwrap_stream(self, stream: object) -> Any:
        """The raw torch stream behind ``stream``; refuse another device's."""
        raise NotImplementedError

    def record(self, stream: StreamLike | None = None) -> None:
        self.raw.record(None if stream is None else self._unwrap_stream(stream))

    def wait(self, stream: StreamLike | None = None) -> None:
        self.raw.wait(None if stream is None else self._unwrap_stream(stream))

    def query(self) -> bool:
        return bool(self.raw.query())

    def synchronize(self) -> None:
        self.raw.synchronize()


_Event = TypeVar("_Event", bound=TorchEvent)


class TorchStream(Generic[_Event]):
    """A ``StreamLike`` over one torch stream (``raw``); equal when the raw streams are.

    Subclasses say which streams and events are theirs (:meth:`_unwrap_stream`,
    :meth:`_unwrap_event`) and how a new event is recorded
    (:meth:`_record_new_event`).
    """

    __slots__ = ("raw",)

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.raw!r})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, type(self)):
            return bool(self.raw == other.raw)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.raw)

    def _unwrap_stream(self, stream: object) -> Any:
        """The raw torch stream behind ``stream``; refuse another device's."""
        raise NotImplementedError

    def _unwrap_event(self, event: object) -> _Event:
        """``event`` as this device's wrapper (wrapping a raw torch event); refuse others."""
        raise NotImplementedError

    def _record_new_event(self) -> _Event:
        """A new event, recorded on this stream."""
        raise NotImplementedError

    def wait_stream(self, stream: StreamLike) -> None:
        self.raw.wait_stream(self._unwrap_stream(stream))

    def wait_event(self, event: EventLike) -> None:
        self.raw.wait_event(self._unwrap_event(event).raw)

    def record_event(self, event: EventLike | None = None) -> _Event:
        if event is None:
            return self._record_new_event()
        recorded = self._unwrap_event(event)
        recorded.raw.record(self.raw)
        return recorded

    def synchronize(self) -> None:
        self.raw.synchronize()


class TorchDeviceHandle:
    """What every device handle over a torch device runtime checks and translates the same way.

    Subclasses give :attr:`device_type` and the device calls below; errors
    name the device as :attr:`_device_label` (``"CUDA"``, or the type) and
    the visibility setting to check as :attr:`_visibility`.
    """

    _device_label: str
    _visibility: str

    @property
    def device_type(self) -> str:
        raise NotImplementedError

    def _require(self, action: str) -> None:
        """Raise ``DeviceUnavailableError`` saying why ``action`` cannot run here."""
        raise NotImplementedError

    def _device_count(self) -> int:
        raise NotImplementedError

    def _set_device_index(self, index: int) -> None:
        raise NotImplementedError

    def _unwrap_stream(self, stream: object) -> Any:
        """The raw torch stream behind ``stream``; refuse another device's."""
        raise NotImplementedError

    def _records_streams(self) -> bool:
        """Whether ``record_stream`` protects anything (a device with one queue: no)."""
        return True

    def _raw_memory_stats(self) -> Mapping[str, Any]:
        raise NotImplementedError

    def set_device(self, device: torch.device | int) -> None:
        """Make ``device`` current; a ``torch.device`` with no index keeps the current one."""
        kind = self.device_type
        if isinstance(device, torch.device):
            if device.type != kind:
                raise DeviceMismatchError(
                    f"{kind}: cannot set device {device}: it is not a {self._device_label} "
                    f"device; pass torch.device({kind!r}, index) or an index"
                )
            index = cast("int | None", device.index)  # None at runtime, typed int
        else:
            index = device
        self._require(f"set device {device}")
        if index is None:
            return
        count = self._device_count()
        if not 0 <= index < count:
            raise DeviceMismatchError(
                f"{kind}: device index {index} is out of range: this process sees {count} "
                f"{self._device_label} device(s), indices 0 to {count - 1}; check LOCAL_RANK "
                f"and {self._visibility}"
            )
        self._set_device_index(index)

    def record_stream(self, tensor: torch.Tensor, stream: StreamLike) -> None:
        if tensor.device.type != self.device_type:
            raise DeviceMismatchError(
                f"{self.device_type}: cannot record a stream on a tensor on {tensor.device}; "
                f"record_stream applies to {self._device_label} tensors only"
            )
        raw = self._unwrap_stream(stream)
        if self._records_streams():
            tensor.record_stream(raw)

    def memory_stats(self) -> dict[str, int]:
        stats = self._raw_memory_stats()
        return {ours: int(stats.get(key, 0)) for ours, key in MEMORY_STAT_KEYS.items()}
