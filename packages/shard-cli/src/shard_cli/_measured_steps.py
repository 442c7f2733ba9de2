"""The steps of a ``shard train`` launch that run under the profiler, and what they measured.

A few consecutive steps (from ``--measure-step``, by default the second of the
launch) are profiled (``_measure.profile_step``) and counted
(``shard_comms.count_collectives``); what each rank holds is measured right
after the last one's optimizer step, gradients still there. See
[Note: gradient accumulation] in ``_train.py`` for what the summary makes of
these figures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from shard_cli._measure import StepTrace, profile_step
from shard_comms import CommCounts, count_collectives
from shard_core import StateBytes, held_bytes, state_bytes

__all__ = ["MeasuredSteps"]

T = TypeVar("T")

# The reported peak is the smallest over these steps: on gloo a collective's buffers are
# freed on the backend's thread when it lets go of them, so a step's measured peak can
# only grow by that timing; five steps make all of them late rarely (three did: a
# tiny-preset run measured 3.11 MB against 2.61-2.81 MB in the others).
_PROFILED_STEPS = 5


class MeasuredSteps:
    """The profiled steps of one launch, and the traces, counts and held bytes they left.

    Attributes:
        first: The first profiled step (the summary's ``measured_step``).
        steps: Every profiled step.
        traces: One per profiled step run so far, in order.
        counts: The collectives of the last profiled step.
        held: What the rank held after the last profiled step's optimizer step.
    """

    def __init__(self, steps: range) -> None:
        self.first = steps.start
        self.steps = steps
        self.traces: list[StepTrace] = []
        self.counts = CommCounts()
        self.held = StateBytes(0, 0, 0)

    @classmethod
    def of(cls, first: int, last: int, measure_step: int | None) -> MeasuredSteps:
        """The steps to profile in a launch that runs ``first`` to ``last``.

        ``measure_step`` (``--measure-step``) is kept within the launch's steps,
        so that a resumed or short run still profiles at least one; unset, it is
        the launch's second step (AdamW creates its state in the first).
        """
        measured = measure_step or min(first + 1, last)
        measured = min(max(measured, first), last)
        return cls(range(measured, min(measured + _PROFILED_STEPS, last + 1)))

    def __contains__(self, step: int) -> bool:
        return step in self.steps

    def profile(
        self,
        device: torch.device,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        run_step: Callable[[], T],
    ) -> T:
        """``run_step()`` under the profiler and the collective counters; what it returned.

        The baseline is what the rank held before the step (parameters and
        optimizer state); the held bytes are taken after it, before
        ``zero_grad`` frees the gradients.
        """
        baseline = held_bytes([*model.parameters(), *_optim_tensors(optim)])
        with count_collectives() as counts, profile_step(device, baseline) as trace:
            result = run_step()
        self.counts = counts
        self.traces.append(trace)
        self.held = state_bytes(model, optim)
        return result

    def rank_record(self, rank: int, rss_peak: int) -> dict[str, int | float]:
        """This rank's entry of the summary's ``ranks`` (gathered from every rank).

        ``peak`` is the lowest of the profiled steps' peaks (see
        ``_PROFILED_STEPS``), ``peak_max`` the highest; ``step_s`` and
        ``comm_s`` are their means, which the summary takes from rank 0.
        """
        traces = self.traces
        return {
            "rank": rank,
            "params": self.held.params,
            "grads": self.held.grads,
            "optim": self.held.optim,
            "peak": min(t.peak_bytes for t in traces),
            "peak_max": max(t.peak_bytes for t in traces),
            "baseline": traces[-1].baseline_bytes,
            "rss_peak": rss_peak,
            "step_s": sum(t.wall_s for t in traces) / len(traces),
            "comm_s": sum(t.comm_s for t in traces) / len(traces),
        }


def _optim_tensors(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        value
        for state in optim.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
