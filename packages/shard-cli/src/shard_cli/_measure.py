"""What a rank holds and what one step costs, measured the same way on every device.

[Note: what a rank holds]
Parameters, gradients and optimizer state are counted as the bytes of the
*storages* behind them, each storage once (``shard_core.state_bytes``, which
``shard_testing.simulate`` counts with too): a ``fully_shard`` parameter's
local tensor is a view of its padded shard, so the padding counts (it is
allocated); the gradients of one unit are views of one reduce-scatter
output, counted once; AdamW's ``exp_avg``/``exp_avg_sq`` are fresh tensors
of the local (unpadded) shape and ``step`` a 4-byte scalar. ``shard plan``
predicts exactly these numbers.

[Note: measuring a step]
One step (batch, forward, backward, optimizer step) runs under
``torch.profiler`` with memory profiling. Peak memory: every allocation and
free of the compute device's allocator is an event with a signed size; the
peak is what the rank held when the step began (parameters, optimizer
state, the collectives' cached staging buffers) plus the highest running
sum of those events. Communication time: the union of the intervals during
which a collective was in flight (gloo and NCCL record one event per
collective, from the moment it is issued to the moment it completes; where
none is recorded, shard's own ``shard::`` ranges are used); compute time is
the rest of the step. The profiler slows a step down, so the figures are for
the split, not for throughput.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

from shard_comms import buffer_cache_info

__all__ = ["StepTrace", "profile_step"]

_COMM_PREFIXES = ("gloo:", "nccl:")


@dataclass
class StepTrace:
    """One profiled step; see [Note: measuring a step].

    Attributes:
        baseline_bytes: What the rank held when the step began.
        peak_bytes: The most the rank held during the step.
        wall_s: The step's wall time (profiled).
        comm_s: Time some collective was in flight.
        comm_events: Number of collectives seen.
    """

    baseline_bytes: int = 0
    peak_bytes: int = 0
    wall_s: float = 0.0
    comm_s: float = 0.0
    comm_events: int = 0
    _start_ns: int = field(default=0, repr=False)

    @property
    def compute_s(self) -> float:
        """The step's time outside communication."""
        return max(0.0, self.wall_s - self.comm_s)


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


@contextmanager
def _without_profiler_notices() -> Iterator[None]:
    """Drop the allocator's notice about blocks allocated before profiling from stderr.

    c10 prints it (once per process) when a tensor allocated before the
    profiler started is freed while it runs, which every step does; any other
    output of the block is passed through.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines(keepends=True):
                if "allocated before the profiling started" not in line:
                    sys.stderr.write(line)
            sys.stderr.flush()


@contextmanager
def profile_step(device: torch.device, baseline_bytes: int) -> Iterator[StepTrace]:
    """Profile the ``with`` block as one step on ``device``; the trace is filled on exit.

    ``baseline_bytes`` is what the rank holds as the block starts that the
    allocator will not report (parameters and optimizer state); the comm
    staging buffers cached by shard-comms are added here.
    """
    # Kineto prints start/stop banners to stderr at its default log level.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    # Garbage from earlier steps freed inside the profiled one would count as negative
    # events and lower the peak (by whatever Python's collector happened to find then).
    gc.collect()
    trace = StepTrace(baseline_bytes=baseline_bytes + buffer_cache_info().bytes)
    with (
        _without_profiler_notices(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        start = time.perf_counter()
        yield trace
        if device.type != "cpu":
            torch.accelerator.synchronize()
        trace.wall_s = time.perf_counter() - start
    events = prof.profiler.kineto_results.events() if prof.profiler else []
    memory = sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and e.device_type().name.lower() == device.type
    )
    running = peak = 0
    for _, nbytes in memory:
        running += nbytes
        peak = max(peak, running)
    trace.peak_bytes = trace.baseline_bytes + peak
    comm = [(e.start_ns(), e.end_ns()) for e in events if e.name().startswith(_COMM_PREFIXES)]
    if not comm:
        comm = [(e.start_ns(), e.end_ns()) for e in events if e.name().startswith("shard::")]
    trace.comm_events = len(comm)
    trace.comm_s = min(trace.wall_s, _union_ns(comm) / 1e9)
