"""CUDA streams and events behind shard's ``StreamLike`` and ``EventLike`` protocols.

``torch.cuda.Stream`` and ``torch.cuda.Event`` already have the protocols'
methods, but their arguments are typed as torch's own classes, so they do not
accept an arbitrary ``StreamLike``. These thin wrappers take any stream or
event this handle produced (or a raw torch one) and unwrap it; ``raw`` is the
torch object for the calls that need it (``torch.cuda.stream``, collectives).
"""

from __future__ import annotations

import torch

from shard_core.errors import DeviceMismatchError
from shard_core.protocols import EventLike, StreamLike

__all__ = ["CudaEvent", "CudaStream", "new_cuda_event", "raw_event", "raw_stream"]


class CudaStream:
    """A ``StreamLike`` over one ``torch.cuda.Stream``; equal when the streams are."""

    __slots__ = ("raw",)

    def __init__(self, raw: torch.cuda.Stream) -> None:
        self.raw = raw

    def __repr__(self) -> str:
        return f"CudaStream({self.raw!r})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CudaStream):
            return bool(self.raw == other.raw)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.raw)

    @property
    def priority(self) -> int:
        """The stream's priority as CUDA clamped it (lower runs first)."""
        return int(self.raw.priority)

    def wait_stream(self, stream: StreamLike) -> None:
        self.raw.wait_stream(raw_stream(stream))

    def wait_event(self, event: EventLike) -> None:
        self.raw.wait_event(raw_event(event))

    def record_event(self, event: EventLike | None = None) -> CudaEvent:
        recorded = new_cuda_event() if event is None else _as_cuda_event(event)
        recorded.raw.record(self.raw)
        return recorded

    def synchronize(self) -> None:
        self.raw.synchronize()


class CudaEvent:
    """An ``EventLike`` over one ``torch.cuda.Event``."""

    __slots__ = ("raw",)

    def __init__(self, raw: torch.cuda.Event) -> None:
        self.raw = raw

    def __repr__(self) -> str:
        return f"CudaEvent({self.raw!r})"

    def record(self, stream: StreamLike | None = None) -> None:
        self.raw.record(None if stream is None else raw_stream(stream))

    def wait(self, stream: StreamLike | None = None) -> None:
        self.raw.wait(None if stream is None else raw_stream(stream))

    def query(self) -> bool:
        return bool(self.raw.query())  # type: ignore[no-untyped-call]

    def synchronize(self) -> None:
        self.raw.synchronize()


def new_cuda_event() -> CudaEvent:
    """A new event (no timing, no interprocess use) on the current device."""
    return CudaEvent(torch.cuda.Event())  # type: ignore[no-untyped-call]


def raw_stream(stream: object) -> torch.cuda.Stream:
    """The ``torch.cuda.Stream`` behind ``stream`` (ours or torch's); any other is refused."""
    if isinstance(stream, CudaStream):
        return stream.raw
    if isinstance(stream, torch.cuda.Stream):
        return stream
    raise DeviceMismatchError(
        f"cuda: {stream!r} ({type(stream).__qualname__}) is not a CUDA stream; "
        "use a stream from the CUDA device handle (new_stream, current_stream)"
    )


def raw_event(event: object) -> torch.cuda.Event:
    """The ``torch.cuda.Event`` behind ``event`` (ours or torch's); any other is refused."""
    return _as_cuda_event(event).raw


def _as_cuda_event(event: object) -> CudaEvent:
    if isinstance(event, CudaEvent):
        return event
    if isinstance(event, torch.cuda.Event):
        return CudaEvent(event)
    raise DeviceMismatchError(
        f"cuda: {event!r} ({type(event).__qualname__}) is not a CUDA event; "
        "use an event from the CUDA device handle (new_event, record_event)"
    )
