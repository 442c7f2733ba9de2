"""README's first command, the main job, runs end to end on local CPU ranks and learns."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_demo_runs_two_ranks_and_reduces_the_loss() -> None:
    """A short run via torch.distributed.run prints falling losses, per-rank shards, a sample."""
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "train_demo.py"),
            "--steps=30",
            "--batch=4",
            "--seq=32",
            "--layers=1",
            "--d-model=32",
            "--lr=1e-2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    out = result.stdout
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 3  # steps 1, 25 and 30
    assert losses[-1] < losses[0]
    assert "rank 0: params" in out
    assert "rank 1: params" in out
    assert re.search(r"all_gather\s+3 calls/step", out)  # one block + root forward, block backward
    assert "sample:" in out
