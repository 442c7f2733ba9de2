"""Device-agnostic streams and events behind shard's ``StreamLike`` and ``EventLike``.

``torch.Stream`` and ``torch.Event`` are torch's generic classes for every
accelerator (each device type plugs its own runtime in underneath). Their
methods take torch's own classes, so these wrappers (shard-core's
:class:`~shard_core.device.TorchStream` and :class:`~shard_core.device.TorchEvent`)
accept any stream or event a handle of the same device type produced and
unwrap it; ``raw`` is the torch object for calls that need it.
"""

from __future__ import annotations

import torch

from shard_core.device import TorchEvent, TorchStream
from shard_core.errors import DeviceMismatchError

__all__ = ["AcceleratorEvent", "AcceleratorStream", "raw_event", "raw_stream"]


class AcceleratorStream(TorchStream["AcceleratorEvent"]):
    """A ``StreamLike`` over one ``torch.Stream``; equal when the streams are."""

    __slots__ = ()

    raw: torch.Stream

    @property
    def device_type(self) -> str:
        return str(self.raw.device.type)

    def _unwrap_stream(self, stream: object) -> torch.Stream:
        return raw_stream(stream, self.device_type)

    def _unwrap_event(self, event: object) -> AcceleratorEvent:
        return _as_event(event, self.device_type)

    def _record_new_event(self) -> AcceleratorEvent:
        return AcceleratorEvent(self.raw.record_event())


class AcceleratorEvent(TorchEvent):
    """An ``EventLike`` over one ``torch.Event``."""

    __slots__ = ()

    raw: torch.Event

    @property
    def device_type(self) -> str:
        return str(self.raw.device.type)

    def _unwrap_stream(self, stream: object) -> torch.Stream:
        return raw_stream(stream, self.device_type)


def raw_stream(stream: object, device_type: str) -> torch.Stream:
    """The ``torch.Stream`` of ``device_type`` behind ``stream`` (ours or torch's)."""
    raw = stream.raw if isinstance(stream, AcceleratorStream) else stream
    if isinstance(raw, torch.Stream) and raw.device.type == device_type:
        return raw
    raise DeviceMismatchError(
        f"{device_type}: {stream!r} ({type(stream).__qualname__}) is not a {device_type} "
        f"stream; use a stream from the {device_type} device handle (new_stream, current_stream)"
    )


def raw_event(event: object, device_type: str) -> torch.Event:
    """The ``torch.Event`` of ``device_type`` behind ``event`` (ours or torch's)."""
    return _as_event(event, device_type).raw


def _as_event(event: object, device_type: str) -> AcceleratorEvent:
    wrapped = AcceleratorEvent(event) if isinstance(event, torch.Event) else event
    if isinstance(wrapped, AcceleratorEvent) and wrapped.device_type == device_type:
        return wrapped
    raise DeviceMismatchError(
        f"{device_type}: {event!r} ({type(event).__qualname__}) is not a {device_type} "
        f"event; use an event from the {device_type} device handle (new_event, record_event)"
    )
