"""Device-agnostic streams and events behind shard's ``StreamLike`` and ``EventLike``.

``torch.Stream`` and ``torch.Event`` are torch's generic classes for every
accelerator (each device type plugs its own runtime in underneath). Their
methods take torch's own classes, so these wrappers accept any stream or
event a handle of the same device type produced and unwrap it; ``raw`` is the
torch object for calls that need it.
"""

from __future__ import annotations

import torch

from shard_core.errors import DeviceMismatchError
from shard_core.protocols import EventLike, StreamLike

__all__ = ["AcceleratorEvent", "AcceleratorStream", "raw_event", "raw_stream"]


class AcceleratorStream:
    """A ``StreamLike`` over one ``torch.Stream``; equal when the streams are."""

    __slots__ = ("raw",)

    def __init__(self, raw: torch.Stream) -> None:
        self.raw = raw

    def __repr__(self) -> str:
        return f"AcceleratorStream({self.raw!r})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, AcceleratorStream):
            return bool(self.raw == other.raw)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.raw)

    @property
    def device_type(self) -> str:
        return str(self.raw.device.type)

    def wait_stream(self, stream: StreamLike) -> None:
        self.raw.wait_stream(raw_stream(stream, self.device_type))

    def wait_event(self, event: EventLike) -> None:
        self.raw.wait_event(raw_event(event, self.device_type))

    def record_event(self, event: EventLike | None = None) -> AcceleratorEvent:
        if event is None:
            return AcceleratorEvent(self.raw.record_event())
        recorded = _as_event(event, self.device_type)
        recorded.raw.record(self.raw)
        return recorded

    def synchronize(self) -> None:
        self.raw.synchronize()


class AcceleratorEvent:
    """An ``EventLike`` over one ``torch.Event``."""

    __slots__ = ("raw",)

    def __init__(self, raw: torch.Event) -> None:
        self.raw = raw

    def __repr__(self) -> str:
        return f"AcceleratorEvent({self.raw!r})"

    @property
    def device_type(self) -> str:
        return str(self.raw.device.type)

    def record(self, stream: StreamLike | None = None) -> None:
        self.raw.record(None if stream is None else raw_stream(stream, self.device_type))

    def wait(self, stream: StreamLike | None = None) -> None:
        self.raw.wait(None if stream is None else raw_stream(stream, self.device_type))

    def query(self) -> bool:
        return bool(self.raw.query())

    def synchronize(self) -> None:
        self.raw.synchronize()


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
