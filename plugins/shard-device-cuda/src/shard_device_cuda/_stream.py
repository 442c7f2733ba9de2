"""CUDA streams and events behind shard's ``StreamLike`` and ``EventLike`` protocols.

``torch.cuda.Stream`` and ``torch.cuda.Event`` already have the protocols'
methods, but their arguments are typed as torch's own classes, so they do not
accept an arbitrary ``StreamLike``. These thin wrappers (shard-core's
:class:`~shard_core.device.TorchStream` and :class:`~shard_core.device.TorchEvent`)
take any stream or event this handle produced (or a raw torch one) and unwrap
it; ``raw`` is the torch object for the calls that need it
(``torch.cuda.stream``, collectives).
"""

from __future__ import annotations

import torch

from shard_core.device import TorchEvent, TorchStream
from shard_core.errors import DeviceMismatchError

__all__ = ["CudaEvent", "CudaStream", "new_cuda_event", "raw_event", "raw_stream"]


class CudaStream(TorchStream["CudaEvent"]):
    """A ``StreamLike`` over one ``torch.cuda.Stream``; equal when the streams are."""

    __slots__ = ()

    raw: torch.cuda.Stream

    @property
    def priority(self) -> int:
        """The stream's priority as CUDA clamped it (lower runs first)."""
        return int(self.raw.priority)

    def _unwrap_stream(self, stream: object) -> torch.cuda.Stream:
        return raw_stream(stream)

    def _unwrap_event(self, event: object) -> CudaEvent:
        return _as_cuda_event(event)

    def _record_new_event(self) -> CudaEvent:
        recorded = new_cuda_event()
        recorded.raw.record(self.raw)
        return recorded


class CudaEvent(TorchEvent):
    """An ``EventLike`` over one ``torch.cuda.Event``."""

    __slots__ = ()

    raw: torch.cuda.Event

    def _unwrap_stream(self, stream: object) -> torch.cuda.Stream:
        return raw_stream(stream)


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
