"""Counting collectives: calls and bytes per kind and label, profiler ranges, debug log lines."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import shard_comms as sc
from shard_comms import plumbing
from shard_comms._counters import record_collective

# ---------------------------------------------------------------------------
# Functions run on every rank
# ---------------------------------------------------------------------------


def _every_collective(world: int) -> None:
    sc.all_gather(torch.empty(4 * world), torch.ones(4), label="a")
    sc.reduce_scatter(torch.empty(4), torch.ones(4 * world), op="avg", label="b")
    sc.reduce_scatter(
        torch.empty(4),
        torch.ones(4 * world),
        reduce_dtype=torch.bfloat16,
        algorithm="reduce_scatter",
    )
    sc.all_reduce(torch.ones(5, dtype=torch.float16), op="avg", label="b")
    sc.broadcast(torch.ones(6, dtype=torch.float64))


def _rank_count_everything() -> dict[str, Any]:
    world = dist.get_world_size()
    sc.reset_comm_counters()
    with sc.count_collectives() as counts:
        _every_collective(world)
    snapshot = sc.comm_counters()
    return {
        "block": counts.as_dict(),
        "global": snapshot.as_dict(),
        "labels": sorted(counts.labels()),
        "a": counts.stats("all_gather", "a"),
        "b_rs": counts.stats("reduce_scatter", "b"),
        "b_ar": counts.stats("all_reduce", "b"),
        "b_calls": counts.calls(label="b"),
    }


def _rank_profiler_ranges() -> list[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        sc.all_gather(torch.empty(4), torch.ones(2), label="layers.0")
        sc.reduce_scatter(torch.empty(2), torch.ones(4))
    return sorted({e.name for e in prof.events() if e.name.startswith("shard::")})


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


def test_world_size_one_makes_no_collective_calls(rank_pool: Any) -> None:
    """At world size 1 every collective is local: the counters stay at zero."""
    (result,) = rank_pool.run(_rank_count_everything, 1)
    zero = {"calls": 0, "bytes": 0}
    assert result["block"] == dict.fromkeys(plumbing.COLLECTIVE_KINDS, zero)
    assert result["global"] == result["block"]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_counts_one_call_per_collective_with_unsharded_bytes(
    rank_pool: Any, world_size: int
) -> None:
    """Each collective counts once, with its unsharded buffer's bytes."""
    results = rank_pool.run(_rank_count_everything, world_size)
    w = world_size
    expected = {
        "all_gather": {"calls": 1, "bytes": 4 * w * 4},
        "reduce_scatter": {"calls": 2, "bytes": 4 * w * 4 + 4 * w * 2},
        "all_reduce": {"calls": 1, "bytes": 5 * 2},
        "broadcast": {"calls": 1, "bytes": 6 * 8},
    }
    for result in results:
        assert result["block"] == expected
        assert result["global"] == expected
        assert result["labels"] == ["a", "b"]
        assert result["a"] == sc.CollectiveStats(calls=1, bytes=4 * w * 4)
        assert result["b_rs"] == sc.CollectiveStats(calls=1, bytes=4 * w * 4)
        assert result["b_ar"] == sc.CollectiveStats(calls=1, bytes=10)
        assert result["b_calls"] == 2


def test_collectives_open_labelled_profiler_ranges(rank_pool: Any) -> None:
    """Each collective shows up in the profiler as shard::<kind>, with its label when given."""
    results = rank_pool.run(_rank_profiler_ranges, 2)
    assert results == [["shard::all_gather (layers.0)", "shard::reduce_scatter"]] * 2


def test_count_collectives_counts_its_block_and_nests() -> None:
    """A block counts only what ran inside it; an inner block counts only its own part."""
    with sc.count_collectives() as outer:
        record_collective("all_gather", 100, "x", 2)
        with sc.count_collectives() as inner:
            record_collective("reduce_scatter", 40, None, 2)
        record_collective("all_gather", 10, None, 2)
    record_collective("broadcast", 1, None, 2)
    assert outer.stats("all_gather") == sc.CollectiveStats(calls=2, bytes=110)
    assert outer.stats("all_gather", "x") == sc.CollectiveStats(calls=1, bytes=100)
    assert outer.calls() == 3
    assert outer.bytes() == 150
    assert inner.as_dict()["reduce_scatter"] == {"calls": 1, "bytes": 40}
    assert inner.calls() == 1
    assert outer.calls("broadcast") == 0
    assert repr(outer) == "CommCounts(all_gather=2/110B, reduce_scatter=1/40B)"
    assert outer.by_label() == {"x": {"all_gather": sc.CollectiveStats(1, 100)}}


def test_comm_counters_snapshot_is_frozen_and_reset_zeroes() -> None:
    """comm_counters() is a snapshot later collectives do not change; reset starts again at zero."""
    sc.reset_comm_counters()
    record_collective("all_reduce", 8, None, 2)
    snapshot = sc.comm_counters()
    record_collective("all_reduce", 8, None, 2)
    assert snapshot.stats("all_reduce") == sc.CollectiveStats(calls=1, bytes=8)
    assert sc.comm_counters().stats("all_reduce") == sc.CollectiveStats(calls=2, bytes=16)
    sc.reset_comm_counters()
    assert sc.comm_counters().calls() == 0


def test_unknown_kind_is_rejected() -> None:
    """Asking for a kind that is not counted names the kinds that are."""
    message = (
        "unknown collective kind 'gather'; the kinds counted are all_gather, reduce_scatter, "
        "all_reduce, broadcast"
    )
    with pytest.raises(sc.CommError, match=re.escape(message)):
        sc.comm_counters().stats("gather")


def test_shard_debug_logs_one_line_per_collective(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With SHARD_DEBUG set each collective writes one debug line to 'shard.comms'; else none."""
    caplog.set_level(logging.DEBUG, logger="shard.comms")
    monkeypatch.delenv("SHARD_DEBUG", raising=False)
    record_collective("all_gather", 64, "layers.1", 4)
    monkeypatch.setenv("SHARD_DEBUG", "0")
    record_collective("all_gather", 64, "layers.1", 4)
    assert caplog.messages == []
    monkeypatch.setenv("SHARD_DEBUG", "1")
    record_collective("all_gather", 64, "layers.1", 4)
    record_collective("broadcast", 8, None, 2)
    assert caplog.messages == [
        "shard::all_gather (layers.1) bytes=64 group_size=4",
        "shard::broadcast (-) bytes=8 group_size=2",
    ]
