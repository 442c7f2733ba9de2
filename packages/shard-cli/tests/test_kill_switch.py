"""The test-only kill switch of ``shard train``: which rank dies, in which attempt, where.

That the kill happens at the point named, and what the survivors then say, is
tested end to end in ``test_restart_end_to_end.py``.
"""

from __future__ import annotations

import pytest

from shard_cli._kill_switch import KillPoint, KillSwitch, kill_point


def _point(value: str, rank: int, attempt: int, world: int = 2) -> KillPoint | None:
    return kill_point(rank, world, attempt, {"SHARD_TRAIN_TEST_KILL_AT_STEP": value})


def test_a_bare_step_kills_the_last_rank_at_its_start_in_the_first_attempt() -> None:
    """The old form: the last rank, at the start of the step, first attempt only."""
    assert _point("5", rank=1, attempt=0) == KillPoint(1, 5, "start")
    assert _point("5", rank=0, attempt=0) is None
    assert _point("5", rank=1, attempt=1) is None


def test_one_entry_per_attempt_names_the_rank_step_and_phase() -> None:
    """Entry i is attempt i's; a rank other than the one named is not killed."""
    value = "0:3:forward,1:5:backward,0:7:optimizer"
    assert _point(value, rank=0, attempt=0) == KillPoint(0, 3, "forward")
    assert _point(value, rank=1, attempt=0) is None
    assert _point(value, rank=1, attempt=1) == KillPoint(1, 5, "backward")
    assert _point(value, rank=0, attempt=2) == KillPoint(0, 7, "optimizer")
    assert _point(value, rank=0, attempt=3) is None
    assert kill_point(0, 2, 0, {}) is None


@pytest.mark.parametrize("entry", ["2:3:forward", "0:3:sideways", "0:three:forward", "0:3"])
def test_a_malformed_entry_says_how_to_write_it(entry: str) -> None:
    with pytest.raises(ValueError, match="SHARD_TRAIN_TEST_KILL_AT_STEP") as error:
        _point(f"5,{entry}", rank=0, attempt=0)
    assert str(error.value) == (
        f"SHARD_TRAIN_TEST_KILL_AT_STEP='5,{entry}': {entry!r} is not STEP or "
        "RANK:STEP:PHASE with a rank below 2 and PHASE one of start, forward, backward, optimizer, "
        "save"
    )


def test_the_switch_stays_quiet_away_from_its_point() -> None:
    """Another step or phase does nothing (the process is still here to assert it)."""
    switch = KillSwitch(KillPoint(0, 3, "optimizer"))
    switch.begin(2)
    switch.at("optimizer")
    switch.begin(3)
    switch.at("forward")
    KillSwitch(None).at("start")
