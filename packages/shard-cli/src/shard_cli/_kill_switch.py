"""A switch for tests: one rank of ``shard train`` SIGKILLs itself at a chosen point of a step.

``SHARD_TRAIN_TEST_KILL_AT_STEP`` holds one entry per attempt of the job,
separated by commas: the first for the first run, the second for the first
restart (``TORCHELASTIC_RESTART_COUNT`` 1), and so on; an attempt without an
entry is not killed. An entry is ``STEP`` (the last rank, at the start of
step ``STEP``) or ``RANK:STEP:PHASE``, ``PHASE`` one of:

- ``start``: before the step draws its batch;
- ``forward``: in forward, once the first block has run (shard's GPT; the
  whole model's forward otherwise);
- ``backward``: at the start of backward (the gradient of the loss);
- ``optimizer``: after backward, before AdamW's step;
- ``save``: after the step, before the checkpoint due then (none due: no kill).

E.g. ``0:5:forward,1:7:optimizer``: rank 0 dies in step 5's forward, and in
the restart rank 1 in step 7's optimizer step.

[Note: Kill points with nothing in flight]
Each point is one where the dying rank has no collective in flight: the
forward one after the first block's all-gather was waited for and before the
next block's starts (shard's forward does not prefetch by default); the
backward one before any backward collective (on the loss, not the logits: the
root unit's pre-backward hook on the logits, registered in forward and so run
first, already issues the last block's all-gather as a prefetch, and whether
the survivor then completes it was a race); the optimizer one after the end of
backward has waited for every reduce-scatter; the save one after the loss's
all-reduce. So the others fail in the same collective on every run (the next
block's forward all-gather, the last block's backward all-gather, the loss's
all-reduce at the end of the step, the save's first collective), and a test
can assert their messages exactly. Standard output and error are flushed
first: SIGKILL drops whatever a buffer holds.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["KILL_ENV", "PHASES", "KillPoint", "KillSwitch", "kill_point"]

KILL_ENV = "SHARD_TRAIN_TEST_KILL_AT_STEP"
PHASES = ("start", "forward", "backward", "optimizer", "save")


@dataclass(frozen=True)
class KillPoint:
    """Where a rank kills itself: its rank, the step, and the phase of the step."""

    rank: int
    step: int
    phase: str


def kill_point(
    rank: int, world: int, attempt: int, environ: Mapping[str, str] | None = None
) -> KillPoint | None:
    """This rank's kill point in this attempt, or ``None``.

    Raises:
        ValueError: the variable is not written as the module says (the message says how).
    """
    env = os.environ if environ is None else environ
    raw = env.get(KILL_ENV, "").strip()
    if not raw:
        return None
    entries = [entry.strip() for entry in raw.split(",")]
    points = [_parse(entry, world, raw) for entry in entries]
    if attempt >= len(points):
        return None
    point = points[attempt]
    return point if point.rank == rank else None


def _parse(entry: str, world: int, raw: str) -> KillPoint:
    parts = entry.split(":")
    try:
        if len(parts) == 1:
            return KillPoint(world - 1, int(parts[0]), "start")
        if len(parts) == 3 and parts[2] in PHASES:
            point = KillPoint(int(parts[0]), int(parts[1]), parts[2])
            if 0 <= point.rank < world:
                return point
    except ValueError:
        pass
    raise ValueError(
        f"{KILL_ENV}={raw!r}: {entry!r} is not STEP or RANK:STEP:PHASE with a rank below "
        f"{world} and PHASE one of {', '.join(PHASES)}"
    )


class KillSwitch:
    """Kills this process at its :class:`KillPoint` (none: never)."""

    def __init__(self, point: KillPoint | None) -> None:
        self.point = point
        self.step = 0  # the step under way, set by begin()

    def begin(self, step: int) -> None:
        """Step ``step`` starts (the ``start`` point)."""
        self.step = step
        self.at("start")

    def at(self, phase: str) -> None:
        """Die here if this is the point."""
        point = self.point
        if point is not None and point.step == self.step and point.phase == phase:
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def arm_forward(self, model: nn.Module) -> None:
        """Hook the ``forward`` point onto the model's first block (before it is sharded)."""
        if self.point is None or self.point.phase != "forward":
            return
        blocks = getattr(model, "blocks", None)
        target = blocks[0] if isinstance(blocks, nn.ModuleList) and len(blocks) else model
        target.register_forward_hook(lambda *_: self.at("forward"))

    def watch_loss(self, loss: torch.Tensor) -> None:
        """Hook the ``backward`` point onto the gradient of ``loss`` (backward's first)."""
        point = self.point
        if point is not None and point.phase == "backward" and point.step == self.step:
            loss.register_hook(lambda grad: self.at("backward"))  # type: ignore[no-untyped-call]
