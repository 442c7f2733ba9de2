"""fully_shard's collectives are named in profiler ranges and in SHARD_DEBUG logs."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from shard_runtime import fully_shard
from shard_testing import RankPool


def _blocks_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))


def _observability() -> dict[str, Any]:
    model = _blocks_model()
    fully_shard(model[2])
    fully_shard(model)
    logger = logging.getLogger("shard.comms")
    records: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = _Collect(level=logging.DEBUG)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    os.environ["SHARD_DEBUG"] = "1"
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model(torch.ones(2, 4)).sum().backward()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    names = sorted({e.name for e in prof.events() if e.name.startswith("shard::")})
    return {"ranges": names, "logs": sorted(set(records))}


def test_profiler_ranges_and_debug_log(rank_pool: RankPool) -> None:
    """Each collective shows as shard::<kind> (<module fqn>) in profiles and in SHARD_DEBUG logs."""
    result = rank_pool.run(_observability, 2)[0]
    assert result["ranges"] == [
        "shard::all_gather (2)",
        "shard::all_gather (Sequential)",
        "shard::reduce_scatter (2)",
        "shard::reduce_scatter (Sequential)",
    ]
    assert any(line.startswith("shard::all_gather (2) bytes=") for line in result["logs"])
    assert any(
        line.startswith("shard::reduce_scatter (Sequential) bytes=") for line in result["logs"]
    )
