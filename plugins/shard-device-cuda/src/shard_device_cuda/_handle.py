"""The CUDA device handle: shard's runtime view of ``torch.cuda``.

The handle answers for device type ``"cuda"`` whether or not CUDA is usable
here, so that ``is_available()`` can say no; anything that needs a device
then raises :class:`DeviceUnavailableError` saying why (a torch build
without CUDA, or no visible GPU). Nothing touches the CUDA runtime until a
method is called: importing the plugin never initialises CUDA, which keeps
forked workers safe.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from shard_core.device import MEMORY_STAT_KEYS, TorchDeviceHandle
from shard_core.errors import DeviceUnavailableError
from shard_core.protocols import DeviceHandle, EventLike, StreamLike
from shard_device_cuda._stream import CudaEvent, CudaStream, new_cuda_event, raw_stream

__all__ = ["MEMORY_STAT_KEYS", "CudaDeviceHandle"]


class CudaDeviceHandle(TorchDeviceHandle):
    """A :class:`~shard_core.protocols.DeviceHandle` for ``"cuda"`` through ``torch.cuda``.

    Streams and events are :class:`CudaStream` and :class:`CudaEvent`
    wrappers; stream priorities are CUDA's (0 is the default, negative runs
    first, values out of range are clamped by CUDA). Memory statistics come
    from the caching allocator of the current device (:data:`MEMORY_STAT_KEYS`).
    Device checks and statistics are shard-core's
    (:class:`~shard_core.device.TorchDeviceHandle`).
    """

    _device_label = "CUDA"
    _visibility = "CUDA_VISIBLE_DEVICES"

    @property
    def device_type(self) -> str:
        return "cuda"

    @property
    def backend(self) -> str:
        return "nccl"

    def __repr__(self) -> str:
        return "CudaDeviceHandle()"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def current_device(self) -> torch.device:
        self._require("find the current device")
        return torch.device("cuda", torch.cuda.current_device())

    def new_stream(self, priority: int = 0) -> CudaStream:
        self._require("create a stream")
        return CudaStream(torch.cuda.Stream(priority=priority))  # type: ignore[no-untyped-call]

    def current_stream(self) -> CudaStream:
        self._require("get the current stream")
        return CudaStream(torch.cuda.current_stream())

    @contextmanager
    def stream(self, stream: StreamLike) -> Iterator[None]:
        with torch.cuda.stream(raw_stream(stream)):
            yield

    def new_event(self) -> CudaEvent:
        self._require("create an event")
        return new_cuda_event()

    def synchronize(self) -> None:
        self._require("synchronize")
        torch.cuda.synchronize()

    def reset_peak_memory_stats(self) -> None:
        self._require("reset peak memory statistics")
        torch.cuda.reset_peak_memory_stats()

    def _device_count(self) -> int:
        return torch.cuda.device_count()

    def _set_device_index(self, index: int) -> None:
        torch.cuda.set_device(index)

    def _unwrap_stream(self, stream: object) -> torch.cuda.Stream:
        return raw_stream(stream)

    def _raw_memory_stats(self) -> Mapping[str, Any]:
        self._require("read memory statistics")
        return torch.cuda.memory_stats()

    def _require(self, action: str) -> None:
        if torch.cuda.is_available():
            return
        if torch.version.cuda is None:
            why = (
                f"this torch build ({torch.__version__}) has no CUDA support; "
                "install a CUDA build of torch"
            )
        else:
            why = (
                f"no CUDA device is visible (torch {torch.__version__}, CUDA "
                f"{torch.version.cuda}); check the driver and CUDA_VISIBLE_DEVICES"
            )
        raise DeviceUnavailableError(f"cuda: cannot {action}: {why}, or use device type 'cpu'")


if TYPE_CHECKING:

    def _conforms(
        handle: CudaDeviceHandle, stream: CudaStream, event: CudaEvent
    ) -> tuple[DeviceHandle, StreamLike, EventLike]:
        """Never called: makes mypy check the classes against shard's protocols."""
        return handle, stream, event
