"""``tools/bench/soak.py`` runs: a 20-step smoke run of both front ends prints its verdicts.

The soak itself (600 steps) is a benchmark run by hand; this only keeps the
script working. Its verdict is not asserted: 15 steps after a 5-step
warm-up are too few for the RSS fit to mean anything.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
