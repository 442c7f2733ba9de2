"""The learning rate of each step of ``shard train``: linear warmup, then constant or cosine.

[Note: the schedule is a function of the step]
The learning rate of step ``s`` (1-based, the step about to run) is computed
from the options and ``s`` alone and written into the optimizer before the
step, never advanced by a scheduler object. So a resumed or restarted run
needs no scheduler state in its checkpoint, and the rate of any step can be
checked by hand:

- warmup (``s <= warmup_steps``): ``lr * s / warmup_steps``, so step 1 already
  learns and step ``warmup_steps`` is at the peak;
- ``constant``: ``lr`` after the warmup;
- ``cosine``: from ``lr`` just after the warmup down to ``min_lr`` at the
  last step, ``min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2`` with
  ``p = (s - warmup_steps) / (steps - warmup_steps)``.

Because the cosine spans ``steps``, a resumed cosine run keeps its
``--steps`` (``_options.resolve_options`` refuses a change).
"""

from __future__ import annotations

import math
from typing import Literal, get_args

__all__ = ["LR_SCHEDULES", "LrSchedule", "lr_at"]

LrSchedule = Literal["constant", "cosine"]
LR_SCHEDULES: tuple[str, ...] = get_args(LrSchedule)


def lr_at(
    step: int,
    *,
    lr: float,
    steps: int,
    warmup_steps: int = 0,
    schedule: str = "constant",
    min_lr: float = 0.0,
) -> float:
    """The learning rate of ``step`` (1 to ``steps``); see [Note: the schedule is a function ...].

    Raises:
        ValueError: ``step`` is outside 1..``steps`` or ``schedule`` is unknown.
    """
    if not 1 <= step <= steps:
        raise ValueError(f"lr_at: step {step} is outside the run's steps 1..{steps}")
    if schedule not in LR_SCHEDULES:
        raise ValueError(
            f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {schedule!r}"
        )
    if step <= warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant":
        return lr
    progress = (step - warmup_steps) / (steps - warmup_steps)
    return min_lr + (lr - min_lr) * (1.0 + math.cos(math.pi * progress)) / 2.0
