"""The learning rate of each step: linear warmup, then constant or cosine down to ``min_lr``."""

from __future__ import annotations

import itertools
import math

import pytest

from shard_cli._schedule import lr_at


def test_warmup_rises_linearly_to_lr_then_stays_constant() -> None:
    """Steps 1..4 of a 4-step warmup are lr/4, 2lr/4, 3lr/4, lr; then lr."""
    rates = [lr_at(s, lr=0.4, steps=8, warmup_steps=4) for s in range(1, 9)]
    assert rates == [0.1, 0.2, 0.30000000000000004, 0.4, 0.4, 0.4, 0.4, 0.4]


def test_no_warmup_constant_is_lr_at_every_step() -> None:
    """The default schedule is --lr throughout."""
    assert [lr_at(s, lr=3e-3, steps=5) for s in range(1, 6)] == [3e-3] * 5


def test_cosine_after_warmup_falls_from_lr_to_min_lr_at_the_last_step() -> None:
    """lr 1.0, min 0.1, 2 warmup steps of 10: half-way through the decay is 0.55, the end 0.1."""
    rates = [
        lr_at(s, lr=1.0, steps=10, warmup_steps=2, schedule="cosine", min_lr=0.1)
        for s in range(1, 11)
    ]
    decay = [0.1 + 0.9 * (1 + math.cos(math.pi * k / 8)) / 2 for k in range(1, 9)]
    assert rates == [0.5, 1.0, *decay]
    assert rates[5] == pytest.approx(0.55, abs=1e-15)  # step 6: p = 4/8
    assert rates[-1] == 0.1
    assert all(a > b for a, b in itertools.pairwise(rates[1:]))


def test_cosine_without_warmup_starts_just_below_lr() -> None:
    """Step 1 of a 4-step cosine already decays: 1 + cos(pi/4) halves."""
    assert lr_at(1, lr=2.0, steps=4, schedule="cosine") == 1.0 + math.cos(math.pi / 4)
    assert lr_at(4, lr=2.0, steps=4, schedule="cosine") == 0.0


def test_warmup_over_every_step_never_reaches_the_cosine() -> None:
    """--warmup-steps equal to --steps: the last step is at lr (no division by zero)."""
    assert lr_at(3, lr=0.3, steps=3, warmup_steps=3, schedule="cosine") == 0.3


@pytest.mark.parametrize(
    ("step", "schedule", "message"),
    [
        (0, "constant", r"lr_at: step 0 is outside the run's steps 1..5"),
        (6, "constant", r"lr_at: step 6 is outside the run's steps 1..5"),
        (1, "linear", r"--lr-schedule must be one of constant, cosine, got 'linear'"),
    ],
)
def test_bad_step_or_schedule_is_an_error(step: int, schedule: str, message: str) -> None:
    """A step outside the run or an unknown schedule names itself."""
    with pytest.raises(ValueError, match=message):
        lr_at(step, lr=1.0, steps=5, schedule=schedule)
