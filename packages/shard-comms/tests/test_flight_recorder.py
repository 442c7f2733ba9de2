"""The flight recorder: its ring, its summaries, and how records of two ranks are compared.

The failure path itself (timeouts, dead ranks, the store exchange) is covered
by ``integration_tests/test_fault_collectives.py``, on ranks of its own.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shard_comms as sc
from shard_comms import _diagnose, _flight, plumbing
from shard_core.errors import CollectiveError, CommError


def _fill(
    recorder: sc.FlightRecorder, labels: list[str], phase: str = "forward all-gather"
) -> None:
    for label in labels:
        entry = recorder.issue("all_gather", label, phase, None, 8, 32, torch.float32)
        recorder.complete(entry)


def test_the_ring_keeps_the_last_entries_in_order() -> None:
    """A ring of 4 after 6 collectives holds the last 4, oldest first, seq still counting."""
    recorder = sc.FlightRecorder(4)
    _fill(recorder, [f"layers.{i}" for i in range(6)])
    entries = recorder.entries()
    assert [e.label for e in entries] == ["layers.2", "layers.3", "layers.4", "layers.5"]
    assert [e.seq for e in entries] == [2, 3, 4, 5]
    assert all(e.state == "completed" and e.end is not None for e in entries)


def test_an_entry_carries_op_phase_step_sizes_and_state() -> None:
    """issue() records what the summary and the failure message name; fail() marks it."""
    recorder = sc.FlightRecorder(8)
    recorder.step = 3
    entry = recorder.issue("reduce_scatter", "layers.1", None, None, 64, 256, torch.bfloat16)
    assert entry is not None
    assert entry.state == "issued"
    recorder.fail(entry)
    data = entry.as_dict()
    assert data["op"] == "reduce_scatter"
    assert data["phase"] == "reduce-scatter"
    assert (data["step"], data["numel"], data["nbytes"], data["dtype"]) == (3, 64, 256, "bfloat16")
    assert data["state"] == "failed"
    summary = recorder.summary()
    assert summary["issued"]["label"] == "layers.1"
    assert summary["completed"] is None


def test_the_loops_step_is_named_over_the_runtimes_count() -> None:
    """set_training_step wins over the runtime's count until it is given None."""
    recorder = sc.FlightRecorder(8)
    recorder.set_runtime_step(4)  # the runtime's root: 4 backwards completed
    recorder.set_training_step(5)  # shard train's step 5
    _fill(recorder, ["layers.0"])
    recorder.set_runtime_step(5)  # the end of the backward: the loop's step stays
    _fill(recorder, ["layers.1"])
    recorder.set_training_step(None)
    _fill(recorder, ["layers.2"])
    assert [(e.label, e.step) for e in recorder.entries()] == [
        ("layers.0", 5),
        ("layers.1", 5),
        ("layers.2", 5),
    ]
    recorder.set_runtime_step(6)
    _fill(recorder, ["layers.3"])
    assert recorder.entries()[-1].step == 6


def test_set_training_step_names_the_steps_of_this_processs_recorder() -> None:
    """The public function and the runtime's (plumbing) act on the process's recorder."""
    recorder = plumbing.reset_flight_recorder(8)
    try:
        plumbing.set_flight_step(2)
        sc.set_training_step(12)
        plumbing.set_flight_step(3)
        assert recorder.step == 12
        sc.set_training_step(None)
        assert recorder.step == 3
    finally:
        plumbing.reset_flight_recorder()


def _entry(seq: int, label: str, phase: str, state: str) -> sc.FlightEntry:
    entry = sc.FlightEntry(seq, "all_gather", label, phase, 5, "0", (0, 1), 8, 32, torch.float32)
    entry.state = state  # type: ignore[assignment]
    return entry


def test_a_missing_rank_is_placed_between_the_collectives_it_did_and_did_not_complete() -> None:
    """The last collective completed with the dead rank is where it was last seen."""
    entries = [
        _entry(16, "GPT", "forward all-gather", "completed"),
        _entry(17, "blocks.0", "forward all-gather", "completed"),
        _entry(18, "blocks.1", "forward all-gather", "failed"),
    ]
    assert _diagnose._last_seen(1, entries) == (
        "rank 1 was last seen in the all-gather of `blocks.0` (forward all-gather, step 5, "
        "seq 17), the last collective it completed with this rank; it did not complete the "
        "all-gather of `blocks.1` (forward all-gather, step 5, seq 18)"
    )
    assert _diagnose._last_seen(1, entries[:2]) == (
        "rank 1 was last seen in the all-gather of `blocks.0` (forward all-gather, step 5, "
        "seq 17), the last collective it completed with this rank"
    )
    assert _diagnose._last_seen(1, entries[2:]) == (
        "rank 1 completed no recorded collective with this rank"
    )
    assert _diagnose._last_seen(2, entries) == (
        "rank 2 completed no recorded collective with this rank"
    )


def test_no_sigterm_report_without_a_process_group() -> None:
    """A process outside any group has no peers to name: the SIGTERM report says nothing."""
    assert _diagnose.termination_report(deadline=0.0) is None


def test_capacity_zero_records_nothing() -> None:
    """SHARD_FLIGHT_RECORDER=0 turns the recorder off: issue() returns None."""
    recorder = sc.FlightRecorder(0)
    assert not recorder.enabled
    assert recorder.issue("all_reduce", None, None, None, 1, 4, torch.float32) is None
    assert recorder.entries() == []
    assert recorder.summary()["issued"] is None


def test_the_environment_sets_the_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    """SHARD_FLIGHT_RECORDER sizes the ring; a non-number names the variable and the fix."""
    monkeypatch.setenv("SHARD_FLIGHT_RECORDER", "16")
    try:
        assert plumbing.reset_flight_recorder().capacity == 16
        monkeypatch.setenv("SHARD_FLIGHT_RECORDER", "many")
        with pytest.raises(CommError, match="SHARD_FLIGHT_RECORDER='many'"):
            plumbing.reset_flight_recorder()
        monkeypatch.delenv("SHARD_FLIGHT_RECORDER")
        assert plumbing.reset_flight_recorder().capacity == _flight.DEFAULT_CAPACITY
    finally:
        plumbing.reset_flight_recorder()
    with pytest.raises(CommError, match="must be >= 0"):
        sc.FlightRecorder(-1)


def _summaries(
    rank0: list[str], rank1: list[str], phase1: str = "forward all-gather"
) -> dict[int, Any]:
    a, b = sc.FlightRecorder(64), sc.FlightRecorder(64)
    a.step = b.step = 2
    _fill(a, rank0)
    _fill(b, rank1, phase1)
    return {0: a.summary(), 1: b.summary()}


def test_divergence_names_the_rank_unit_phase_step_and_seq() -> None:
    """Rank 1 skipping layers.1: its seq 1 is layers.2 where rank 0's is layers.1."""
    summaries = _summaries(["layers.0", "layers.1", "layers.2"], ["layers.0", "layers.2"])
    assert _diagnose.find_divergence(summaries) == (
        "rank 1 issued the all-gather of `layers.2` (forward all-gather, step 2, seq 1) "
        "where rank 0 issued `layers.1`"
    )
    behind = _diagnose._behind(summaries)
    assert behind
    assert behind[0].startswith("rank 1 is behind on group -")


def test_same_records_have_no_divergence_and_a_phase_difference_is_one() -> None:
    """Equal records compare equal; the same unit in another phase is a difference."""
    assert _diagnose.find_divergence(_summaries(["a", "b"], ["a", "b"])) is None
    found = _diagnose.find_divergence(_summaries(["a"], ["a"], "backward all-gather"))
    assert found is not None
    assert "(backward all-gather, step 2, seq 0)" in found


def test_the_dump_table_marks_the_first_difference(tmp_path: Any) -> None:
    """format_flight_table prints both ranks side by side, marks the row, names the difference."""
    summaries = _summaries(["layers.0", "layers.1"], ["layers.0", "layers.2"])
    records = {}
    for rank, summary in summaries.items():
        record = copy.deepcopy(summary)
        record.update(rank=rank, reason="RuntimeError: timed out", entries=record["recent"])
        records[rank] = record
    table = sc.format_flight_table(records)
    assert "rank 0" in table
    assert "rank 1" in table
    assert any(line.startswith("!") and "layers.2" in line for line in table.splitlines())
    assert "first difference: rank 1 issued the all-gather of `layers.2`" in table
    with pytest.raises(CommError, match="SHARD_FLIGHT_RECORDER_DUMP"):
        sc.load_flight_dump(tmp_path)


def test_a_failure_without_a_process_group_still_names_this_rank() -> None:
    """No default group: the message names rank 0, its last collective, and keeps going."""
    recorder = plumbing.reset_flight_recorder(8)
    try:
        entry = recorder.issue(
            "all_gather", "layers.3", "backward all-gather", None, 4, 16, torch.float32
        )
        error = _diagnose.collective_failure(entry, RuntimeError("Timed out waiting 5000ms"))
    finally:
        plumbing.reset_flight_recorder()
    assert isinstance(error, CollectiveError)
    assert isinstance(error, RuntimeError)
    assert str(error).splitlines() == [
        "collective failed on rank 0 of 1: all-gather of `layers.3` (backward all-gather, "
        "step 0, seq 0) raised RuntimeError: Timed out waiting 5000ms",
        "  rank 0 (this rank): last issued all-gather of `layers.3` (backward all-gather, "
        "step 0, seq 0) [failed]; last completed nothing",
        "  fix: make every rank run the same modules in the same order each step (no "
        "rank-dependent control flow around sharded modules), and check the named rank's log; "
        "set SHARD_FLIGHT_RECORDER_DUMP=DIR and run `shard debug flight DIR` for the full "
        "record",
    ]


def _rank_records() -> list[tuple[str, str | None, str, int, str, int]]:
    plumbing.reset_flight_recorder(32)
    plumbing.set_flight_step(5)
    flat = torch.ones(4)
    world_size = dist.get_world_size()
    out = torch.empty(4 * world_size)
    sc.all_gather(out, flat, label="layers.0", phase="forward all-gather").wait()
    handle = sc.all_reduce(flat, label="root", async_op=True)
    issued = sc.flight_recorder().entries()[-1].state
    handle.wait()
    sc.reduce_scatter(torch.empty(4), torch.ones(4 * world_size), label="layers.0")
    entries = sc.flight_recorder().entries()
    plumbing.reset_flight_recorder()
    assert issued == "issued"
    return [(e.op, e.label, e.phase, e.step, e.state, e.seq) for e in entries]


def test_collectives_record_op_label_phase_step_and_complete_on_wait(rank_pool: Any) -> None:
    """On 2 gloo ranks every collective is recorded; an async one completes when waited."""
    for records in rank_pool.run(_rank_records, 2):
        assert records == [
            ("all_gather", "layers.0", "forward all-gather", 5, "completed", 0),
            ("all_reduce", "root", "all-reduce", 5, "completed", 1),
            ("reduce_scatter", "layers.0", "reduce-scatter", 5, "completed", 2),
        ]


def test_a_failure_while_comparing_records_still_reports_the_backend_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """If reading the records breaks, the CollectiveError still names the op and the cause."""

    def broken(*args: object) -> None:
        raise OSError("store on fire")

    monkeypatch.setattr(_diagnose, "_publish_and_gather", broken)
    entry = sc.FlightRecorder(4).issue("all_reduce", "root", None, None, 2, 8, torch.float32)
    error = _diagnose.collective_failure(entry, RuntimeError("Connection closed by peer"))
    assert isinstance(error, CollectiveError)
    assert "all-reduce of `root` (all-reduce, step 0, seq 0) raised RuntimeError" in str(error)
    assert "could not be compared: OSError: store on fire" in str(error)
