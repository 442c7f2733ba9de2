"""``shard train`` with the wrapper, hybrid sharding, bf16, grad-op and CPU offload.

Each run checks what every configuration must satisfy: the loss falls, each
rank holds exactly the bytes ``shard plan`` predicts, the peak is within 10%
of the prediction, and (wrapper) a checkpoint resumes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

TINY = ["--preset", "tiny", "--batch", "4", "--seq", "32", "--sample-chars", "0"]


def _train(cwd: Path, *args: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "shard_cli", "train", *TINY, *args, "--run-dir", "r"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary: dict[str, Any] = json.loads((cwd / "r" / "summary.json").read_text("utf-8"))
    return summary


def _check(summary: dict[str, Any]) -> None:
    plan = summary["plan"]
    for measured, predicted in zip(summary["ranks"], plan["ranks"], strict=True):
        assert [measured[k] for k in ("params", "grads", "optim")] == [
            predicted[k] for k in ("params", "grads", "optim")
        ]
        assert abs(measured["peak"] - plan["peak"]) <= 0.1 * measured["peak"], (measured, plan)
    assert summary["last_loss"] < summary["first_loss"]


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["loss"] for line in lines]


def test_wrapper_hybrid_bf16_trains_and_resumes_under_fully_shard(tmp_path: Path) -> None:
    """Wrapper, HYBRID_SHARD over 2 replicas of 1 rank, bf16: exact bytes; its checkpoint
    resumes under fully_shard with FULL_SHARD, continuing an uninterrupted run's curve."""
    wrapper = ["--frontend", "wrapper", "--strategy", "hybrid", "--shard-size", "1"]
    summary = _train(tmp_path, *wrapper, "--precision", "bf16", "--steps", "5", "--ckpt-every", "5")
    _check(summary)
    assert summary["comm_per_step"]["all_reduce"]["calls"] == 3  # across replicas, per unit
    switched = ["--frontend", "fully_shard", "--strategy", "full"]
    resumed = _train(tmp_path, "--resume", *switched, "--steps", "7")
    assert resumed["steps_run"] == 2
    lines = (tmp_path / "r" / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 8))
    whole = tmp_path / "uninterrupted"
    whole.mkdir()
    _train(whole, *wrapper, "--precision", "bf16", "--steps", "7")
    expected = _losses(whole / "r")
    got = _losses(tmp_path / "r")
    assert got[:5] == expected[:5]
    assert got[5:] == pytest.approx(expected[5:], rel=1e-2)


def test_grad_op_with_cpu_offload_holds_what_the_plan_says(tmp_path: Path) -> None:
    """fully_shard, SHARD_GRAD_OP, CPU offload: exact bytes; the peak within 10% of the plan."""
    _check(_train(tmp_path, "--strategy", "grad-op", "--cpu-offload", "--steps", "4"))
