"""The CUDA device handle on a GPU: stream priorities and events, record_stream, memory stats."""

from __future__ import annotations

import pytest
import torch

from shard_core.protocols import DeviceHandle, EventLike, StreamLike
from shard_device_cuda import CudaDeviceHandle

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# About 50-200 ms of GPU time: long enough that unordered work would race.
SPIN_CYCLES = 200_000_000
MIB = 1 << 20


@pytest.fixture
def handle() -> CudaDeviceHandle:
    handle = CudaDeviceHandle()
    handle.synchronize()
    return handle


def test_handle_reports_the_visible_gpus(handle: CudaDeviceHandle) -> None:
    """is_available, device_count and current_device agree with torch.cuda."""
    assert isinstance(handle, DeviceHandle)
    assert handle.is_available() is True
    assert handle.device_count() == torch.cuda.device_count()
    assert handle.current_device() == torch.device("cuda", torch.cuda.current_device())
    handle.set_device(torch.device("cuda", 0))
    assert handle.current_device() == torch.device("cuda", 0)


def test_streams_carry_their_priority(handle: CudaDeviceHandle) -> None:
    """new_stream(priority) gives a StreamLike of that priority; out-of-range values are clamped."""
    least, greatest = torch.cuda.Stream.priority_range()
    low = handle.new_stream()
    high = handle.new_stream(priority=greatest)
    clamped = handle.new_stream(priority=greatest - 100)
    assert isinstance(high, StreamLike)
    assert (low.priority, high.priority, clamped.priority) == (least, greatest, greatest)
    assert high != low
    assert handle.current_stream() == handle.current_stream()


def test_event_orders_a_high_priority_stream_after_a_busy_one(handle: CudaDeviceHandle) -> None:
    """Work on a high-priority stream waits for an event recorded behind slow work elsewhere."""
    producer = handle.new_stream(priority=0)
    consumer = handle.new_stream(priority=torch.cuda.Stream.priority_range()[1])
    source = torch.zeros(1 << 20, device="cuda")
    handle.synchronize()
    with handle.stream(producer):
        torch.cuda._sleep(SPIN_CYCLES)
        source.fill_(1.0)
    ready = producer.record_event()
    assert isinstance(ready, EventLike)
    assert ready.query() is False
    consumer.wait_event(ready)
    with handle.stream(consumer):
        result = source * 2.0
    done = consumer.record_event()
    done.synchronize()
    assert ready.query() is True
    assert torch.equal(result, torch.full_like(source, 2.0))


def test_wait_stream_orders_the_current_stream(handle: CudaDeviceHandle) -> None:
    """current_stream().wait_stream(side) makes later current-stream work see the side stream's."""
    side = handle.new_stream()
    target = torch.zeros(1024, device="cuda")
    handle.synchronize()
    with handle.stream(side):
        torch.cuda._sleep(SPIN_CYCLES)
        target.fill_(3.0)
    handle.current_stream().wait_stream(side)
    total = target.sum()
    handle.current_stream().synchronize()
    assert total.item() == 3.0 * 1024


def test_event_wait_and_record_on_explicit_streams(handle: CudaDeviceHandle) -> None:
    """An event from new_event records on one stream and makes another wait for it."""
    first, second = handle.new_stream(), handle.new_stream()
    event = handle.new_event()
    buffer = torch.zeros(256, device="cuda")
    handle.synchronize()
    with handle.stream(first):
        torch.cuda._sleep(SPIN_CYCLES)
        buffer.add_(5.0)
    event.record(first)
    event.wait(second)
    with handle.stream(second):
        doubled = buffer * 2.0
    second.synchronize()
    event.synchronize()
    assert event.query() is True
    assert torch.equal(doubled, torch.full_like(buffer, 10.0))


def test_record_stream_keeps_memory_from_reuse_while_a_stream_uses_it(
    handle: CudaDeviceHandle,
) -> None:
    """Freed memory recorded on a busy side stream is not handed out again; unrecorded memory is."""
    side = handle.new_stream()
    numel = 4 * MIB // 4

    def free_after_use_on_side(record: bool) -> int:
        tensor = torch.empty(numel, device="cuda")
        handle.current_stream().synchronize()
        side.wait_stream(handle.current_stream())
        with handle.stream(side):
            torch.cuda._sleep(SPIN_CYCLES)
            tensor.fill_(1.0)
        if record:
            handle.record_stream(tensor, side)
        pointer = tensor.data_ptr()
        del tensor
        again = torch.empty(numel, device="cuda")
        reused = again.data_ptr() == pointer
        side.synchronize()
        del again
        return int(reused)

    assert free_after_use_on_side(record=False) == 1
    assert free_after_use_on_side(record=True) == 0


def test_memory_stats_follow_an_allocation(handle: CudaDeviceHandle) -> None:
    """allocated and peak_allocated move by exactly a tensor's bytes; a reset restarts the peak."""
    torch.cuda.empty_cache()
    handle.reset_peak_memory_stats()
    before = handle.memory_stats()
    assert before["peak_allocated"] == before["allocated"]
    block = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    during = handle.memory_stats()
    assert during["allocated"] - before["allocated"] == 64 * MIB
    assert during["peak_allocated"] == during["allocated"]
    assert during["reserved"] >= during["allocated"]
    del block
    after = handle.memory_stats()
    assert after["allocated"] == before["allocated"]
    assert after["peak_allocated"] == during["peak_allocated"]
    handle.reset_peak_memory_stats()
    assert handle.memory_stats()["peak_allocated"] == after["allocated"]
