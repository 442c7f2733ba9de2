"""``tools/bench/soak.py`` runs: a 20-step smoke run of both front ends prints its verdicts.

The soak itself (600 steps) is a benchmark run by hand; this only keeps the
script working. Its verdict is not asserted: 15 steps after a 5-step
warm-up are too few for the RSS fit to mean anything. The soak under faults
(``--faults``, half an hour) is not run here: its report and how it finds the
ranks to kill are tested on their own, and a killed rank's restart end to end
in ``test_restart_end_to_end.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def test_soak_smoke_run_prints_a_verdict_per_front_end(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    args = ["--steps", "20", "--warmup", "5", "--ckpt-every", "10", "--sample-every", "10"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench" / "soak.py"), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode in (0, 1), result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    for frontend in ("fully_shard", "wrapper"):
        assert any(
            line.startswith(f"{frontend}: flat") or line.startswith(f"{frontend}: grows")
            for line in lines
        ), result.stdout
    data = json.loads(out.read_text(encoding="utf-8"))
    assert [(v["frontend"], v["rank"]) for v in data["verdicts"]] == [
        ("fully_shard", 0),
        ("fully_shard", 1),
        ("wrapper", 0),
        ("wrapper", 1),
    ]
    for traces in data["traces"].values():
        for trace in traces:
            assert [step for step, _ in trace["rss"]] == list(range(1, 21))
            assert [t[0] for t in trace["tensors"]] == [1, 10, 20]


def _soak_faults() -> Any:
    """``tools/bench/soak_faults.py`` as a module (the soak itself runs for half an hour)."""
    spec = importlib.util.spec_from_file_location(
        "soak_faults", ROOT / "tools" / "bench" / "soak_faults.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak_faults"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_fault_soak_counts_restarts_steps_lost_and_compares_the_curves() -> None:
    """Kills and the run's notes give restarts and steps lost; equal curves are equal."""
    soak = _soak_faults()
    report = soak.FaultReport(config=vars(soak.FaultConfig()) | {"world_size": 2})
    report.kills = [soak.Kill(60.0, 0, 11, 34), soak.Kill(150.0, 1, 12, 52)]
    stderr = "\n".join(
        [
            "  did not answer: rank 0 (dead, or stuck outside a collective; ...)",
            "shard train: restart 1 after a rank failed: resuming from the checkpoint at step 25 "
            "(run/checkpoint)",
            # The second kill (rank 1) is not named before its restart: only rank 0 is.
            "  did not answer: rank 0 (dead, or stuck outside a collective; ...)",
            "shard train: restart 2 after a rank failed: resuming from the checkpoint at step 50 "
            "(run/checkpoint)",
            "  did not answer: rank 1 (dead, or stuck outside a collective; ...)",
        ]
    )
    curve = [(step, 4.0 - step / 100) for step in range(1, 61)]
    soak.analyse(report, stderr, curve, list(curve))
    assert report.resumed_from == [25, 50]
    assert report.steps_lost == [9, 2]
    assert (report.named, report.steps, report.equal, report.problems) == (1, 60, True, [])
    lines = soak.summary_lines(report)
    assert lines[1:] == [
        "kills: 2 (rank 0: 1, rank 1: 1); restarts: 2; named by a survivor: 1 of 2",
        "steps lost: 11 in all (trained again after a restart), 5.5 per kill, at most 9",
        "loss curve: equal to the uninterrupted run's at every step 1-60 (final loss 3.4)",
    ]
    other = soak.FaultReport(config=report.config, kills=report.kills[:1])
    changed = [*curve[:40], (41, 9.0), *curve[41:]]
    soak.analyse(other, stderr, curve, changed)
    assert (other.equal, other.first_difference) == (False, 41)
    assert other.problems == ["1 kills but 2 restarts in the output"]


def test_fault_soak_finds_a_launchers_ranks_by_their_rank_variable(tmp_path: Path) -> None:
    """The ranks are the launcher's children with RANK in their environment."""
    soak = _soak_faults()
    env = {**os.environ, "RANK": "1"}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    try:
        deadline = time.monotonic() + 30
        while soak.rank_pids(os.getpid()).get(1) != child.pid and time.monotonic() < deadline:
            time.sleep(0.1)  # until exec has replaced the forked environment
        assert soak.rank_pids(os.getpid())[1] == child.pid
    finally:
        child.kill()
        child.wait()
    metrics = tmp_path / "metrics.jsonl"
    assert soak.last_step(metrics) == 0
    metrics.write_text('{"step": 1, "loss": 4.5}\n{"step": 2, "loss": 4.4}\n{"step": 3, "lo')
    assert soak.last_step(metrics) == 2
