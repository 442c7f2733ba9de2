"""shard_core.device: the stream, event and handle parts every torch-backed device plugin shares."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from shard_core.device import MEMORY_STAT_KEYS, TorchDeviceHandle, TorchEvent, TorchStream
from shard_core.errors import DeviceMismatchError


class _Raw:
    """Stands in for a torch stream or event and records what it was called with."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __repr__(self) -> str:
        return self.name

    def __getattr__(self, method: str) -> Any:
        def record(*args: Any) -> bool:
            self.calls.append((method, args))
            return True

        return record


class _Event(TorchEvent):
    __slots__ = ()

    def _unwrap_stream(self, stream: object) -> Any:
        assert isinstance(stream, _Stream)
        return stream.raw


class _Stream(TorchStream[_Event]):
    __slots__ = ()

    def _unwrap_stream(self, stream: object) -> Any:
        assert isinstance(stream, _Stream)
        return stream.raw

    def _unwrap_event(self, event: object) -> _Event:
        assert isinstance(event, _Event)
        return event

    def _record_new_event(self) -> _Event:
        event = _Event(_Raw("new"))
        event.raw.record(self.raw)
        return event


class _Handle(TorchDeviceHandle):
    _device_label = "FAKE"
    _visibility = "FAKE_VISIBLE_DEVICES"

    def __init__(self) -> None:
        self.chosen: list[int] = []

    @property
    def device_type(self) -> str:
        return "meta"

    def _require(self, action: str) -> None:
        pass

    def _device_count(self) -> int:
        return 2

    def _set_device_index(self, index: int) -> None:
        self.chosen.append(index)

    def _unwrap_stream(self, stream: object) -> Any:
        return stream

    def _raw_memory_stats(self) -> Mapping[str, Any]:
        return {"allocated_bytes.all.current": 5, "num_ooms": 1, "other": 9}


def test_wrappers_forward_to_the_raw_objects_they_unwrap() -> None:
    """Streams wait on and record raw objects; a new event is recorded on the stream."""
    a, b, e = _Raw("a"), _Raw("b"), _Raw("e")
    stream, event = _Stream(a), _Event(e)
    stream.wait_stream(_Stream(b))
    stream.wait_event(event)
    assert stream.record_event(event) is event
    fresh = stream.record_event()
    event.record()
    event.wait(stream)
    assert event.query() is True
    assert a.calls == [("wait_stream", (b,)), ("wait_event", (e,))]
    assert e.calls == [("record", (a,)), ("record", (None,)), ("wait", (a,)), ("query", ())]
    assert fresh.raw.calls == [("record", (a,))]
    assert stream == _Stream(a)
    assert hash(stream) == hash(_Stream(a))
    assert stream != _Stream(b)
    assert repr(stream) == "_Stream(a)"


def test_set_device_checks_type_and_range() -> None:
    """Another device type or an index past the count is refused, naming the fix."""
    handle = _Handle()
    with pytest.raises(
        DeviceMismatchError,
        match=re.escape(
            "meta: cannot set device cpu: it is not a FAKE device; pass "
            "torch.device('meta', index) or an index"
        ),
    ):
        handle.set_device(torch.device("cpu"))
    with pytest.raises(
        DeviceMismatchError,
        match=re.escape(
            "meta: device index 2 is out of range: this process sees 2 FAKE device(s), "
            "indices 0 to 1; check LOCAL_RANK and FAKE_VISIBLE_DEVICES"
        ),
    ):
        handle.set_device(2)
    handle.set_device(torch.device("meta", 1))
    handle.set_device(torch.device("meta"))
    assert handle.chosen == [1]


def test_record_stream_refuses_another_devices_tensor() -> None:
    """record_stream names the tensor's device."""
    with pytest.raises(DeviceMismatchError, match="applies to FAKE tensors only"):
        _Handle().record_stream(torch.zeros(1), _Stream(_Raw("s")))


def test_memory_stats_translate_the_allocator_keys() -> None:
    """Our names, from the allocator's keys; a key it does not report reads 0."""
    stats = _Handle().memory_stats()
    assert set(stats) == set(MEMORY_STAT_KEYS)
    assert (stats["allocated"], stats["num_ooms"], stats["peak_active"]) == (5, 1, 0)
