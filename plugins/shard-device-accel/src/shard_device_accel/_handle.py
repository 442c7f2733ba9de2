"""Device handles for accelerators other than CUDA, through ``torch.accelerator``.

``torch.accelerator`` is torch's device-agnostic runtime API: it drives
whichever accelerator this process uses (xpu, hpu, npu, mps...), and
``torch.Stream``/``torch.Event`` are the matching generic stream and event
classes. One handle class therefore serves every type in
:data:`ACCELERATOR_TYPES`; the table holds what differs per type: the
``torch.distributed`` backend, and whether the type has more than one
stream.

A handle is only handed out for a type that is present: the type of
``torch.accelerator.current_accelerator()``, or a type whose ``torch.<type>``
module reports itself available. Device work goes through
``torch.accelerator``, which drives one type per process, so a handle for a
type that is not the current accelerator says ``is_available() == False`` and
refuses device work with a clear error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from shard_core.device import MEMORY_STAT_KEYS, TorchDeviceHandle
from shard_core.errors import DeviceMismatchError, DeviceUnavailableError
from shard_core.protocols import DeviceHandle, EventLike, StreamLike
from shard_device_accel._stream import AcceleratorEvent, AcceleratorStream, raw_stream

__all__ = [
    "ACCELERATOR_TYPES",
    "MEMORY_STAT_KEYS",
    "AcceleratorDeviceHandle",
    "AcceleratorType",
    "accelerator_handle",
]


@dataclass(frozen=True, slots=True)
class AcceleratorType:
    """What the handle needs to know about one accelerator type.

    Attributes:
        backend: The ``torch.distributed`` backend for this type.
        multi_stream: Whether the type runs several streams. Where it does not
            (mps: one command queue per process), ``new_stream`` returns the
            current stream, so work stays ordered without any waiting, and
            ``record_stream`` has nothing to protect and does nothing.
    """

    backend: str
    multi_stream: bool = True


ACCELERATOR_TYPES: Mapping[str, AcceleratorType] = {
    "hpu": AcceleratorType(backend="hccl"),
    "mps": AcceleratorType(backend="gloo", multi_stream=False),
    "npu": AcceleratorType(backend="hccl"),
    "xpu": AcceleratorType(backend="xccl"),
}
"""The accelerator types this plugin serves. ``cpu`` and ``cuda`` are never among them."""


def accelerator_handle(device_type: str) -> AcceleratorDeviceHandle | None:
    """A handle for ``device_type`` when that accelerator is present, else ``None``."""
    if device_type not in ACCELERATOR_TYPES:
        return None
    current = torch.accelerator.current_accelerator()
    if current is not None and current.type == device_type:
        return AcceleratorDeviceHandle(device_type)
    module = getattr(torch, device_type, None)
    is_available = getattr(module, "is_available", None)
    if callable(is_available) and is_available():
        return AcceleratorDeviceHandle(device_type)
    return None


class AcceleratorDeviceHandle(TorchDeviceHandle):
    """A :class:`~shard_core.protocols.DeviceHandle` for one type of :data:`ACCELERATOR_TYPES`.

    Streams and events are :class:`AcceleratorStream` and
    :class:`AcceleratorEvent` over ``torch.Stream`` and ``torch.Event``; stream
    priorities follow torch (0 is the default, negative runs first). Memory
    statistics come from ``torch.accelerator.memory_stats`` where the
    installed torch has it (:data:`MEMORY_STAT_KEYS`). Device checks and
    statistics are shard-core's (:class:`~shard_core.device.TorchDeviceHandle`).
    """

    _visibility = "the device visibility settings"

    def __init__(self, device_type: str) -> None:
        if device_type not in ACCELERATOR_TYPES:
            raise DeviceMismatchError(
                f"shard-device-accel serves {sorted(ACCELERATOR_TYPES)}, not {device_type!r}; "
                "cpu is built into shard-core and cuda comes from shard-device-cuda"
            )
        self._device_type = device_type
        self._device_label = device_type
        self._type = ACCELERATOR_TYPES[device_type]

    @property
    def device_type(self) -> str:
        return self._device_type

    @property
    def backend(self) -> str:
        return self._type.backend

    def __repr__(self) -> str:
        return f"AcceleratorDeviceHandle({self._device_type!r})"

    def is_available(self) -> bool:
        return self._current_type() == self._device_type and torch.accelerator.is_available()

    def device_count(self) -> int:
        if self._current_type() != self._device_type:
            return 0
        return torch.accelerator.device_count()

    def current_device(self) -> torch.device:
        self._require("find the current device")
        return torch.device(self._device_type, torch.accelerator.current_device_index())

    def new_stream(self, priority: int = 0) -> AcceleratorStream:
        self._require("create a stream")
        if not self._type.multi_stream:
            return AcceleratorStream(torch.accelerator.current_stream())
        device = torch.device(self._device_type, torch.accelerator.current_device_index())
        return AcceleratorStream(torch.Stream(device=device, priority=priority))

    def current_stream(self) -> AcceleratorStream:
        self._require("get the current stream")
        return AcceleratorStream(torch.accelerator.current_stream())

    @contextmanager
    def stream(self, stream: StreamLike) -> Iterator[None]:
        with raw_stream(stream, self._device_type):
            yield

    def new_event(self) -> AcceleratorEvent:
        self._require("create an event")
        device = torch.device(self._device_type, torch.accelerator.current_device_index())
        return AcceleratorEvent(torch.Event(device=device))

    def synchronize(self) -> None:
        self._require("synchronize")
        torch.accelerator.synchronize()

    def reset_peak_memory_stats(self) -> None:
        self._memory_function("reset_peak_memory_stats", "reset peak memory statistics")()

    def _device_count(self) -> int:
        return torch.accelerator.device_count()

    def _set_device_index(self, index: int) -> None:
        torch.accelerator.set_device_index(index)

    def _unwrap_stream(self, stream: object) -> torch.Stream:
        return raw_stream(stream, self._device_type)

    def _records_streams(self) -> bool:
        return self._type.multi_stream

    def _raw_memory_stats(self) -> Mapping[str, Any]:
        read = self._memory_function("memory_stats", "read memory statistics")
        stats: Mapping[str, Any] = read()
        return stats

    def _memory_function(self, name: str, action: str) -> Callable[[], Any]:
        self._require(action)
        function = getattr(torch.accelerator, name, None)
        if function is None:
            raise DeviceUnavailableError(
                f"{self._device_type}: cannot {action}: torch {torch.__version__} has no "
                f"torch.accelerator.{name}; upgrade torch"
            )
        return cast("Callable[[], Any]", function)

    def _current_type(self) -> str | None:
        current = torch.accelerator.current_accelerator()
        return None if current is None else current.type

    def _require(self, action: str) -> None:
        current = self._current_type()
        if current != self._device_type:
            drives = "no accelerator" if current is None else f"{current!r}"
            raise DeviceUnavailableError(
                f"{self._device_type}: cannot {action}: torch.accelerator drives {drives} "
                f"in this process, not {self._device_type!r}; shard-device-accel reaches a "
                f"device only through torch.accelerator, so run where {self._device_type} "
                "is the current accelerator"
            )
        if not torch.accelerator.is_available():
            raise DeviceUnavailableError(
                f"{self._device_type}: cannot {action}: torch was built for "
                f"{self._device_type} but no {self._device_type} device is usable here; "
                "check the driver and the device visibility settings, or use device type 'cpu'"
            )


if TYPE_CHECKING:

    def _conforms(
        handle: AcceleratorDeviceHandle, stream: AcceleratorStream, event: AcceleratorEvent
    ) -> tuple[DeviceHandle, StreamLike, EventLike]:
        """Never called: makes mypy check the classes against shard's protocols."""
        return handle, stream, event
