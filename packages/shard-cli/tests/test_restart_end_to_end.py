"""``shard train --max-restarts``: a killed rank restarts the job, which continues exactly.

Two local CPU ranks train the tiny preset for 8 steps with a checkpoint
every 3. The last rank SIGKILLs itself at the start of a step of the first
attempt (``SHARD_TRAIN_TEST_KILL_AT_STEP``, a test-only hook in ``_train.py``).
With ``--max-restarts 1`` the run exits 0 and its per-step losses equal the
uninterrupted run's bit for bit; without it ``shard train`` exits 1 naming
the killed rank, and the checkpoint it leaves reads back whole. (That a
restart never takes a checkpoint an earlier launch left in the run directory
is tested in ``test_restart.py``.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shard_checkpoint import consolidate
from shard_cli._train_checkpoint import read_info

TINY = ["--preset", "tiny", "--batch", "4", "--seq", "32", "--ckpt-every", "3"]
STEPS = 8


def shard(
    *args: str, cwd: Path, kill_at: int | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("SHARD_TRAIN_TEST_KILL_AT_STEP", None)
    if kill_at is not None:
        env["SHARD_TRAIN_TEST_KILL_AT_STEP"] = str(kill_at)
    return subprocess.run(
        [sys.executable, "-m", "shard_cli", "train", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def losses(run_dir: Path) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


def output(result: subprocess.CompletedProcess[str]) -> str:
    return result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, float]]:
    where = tmp_path_factory.mktemp("uninterrupted")
    args = [*TINY, "--steps", str(STEPS), "--sample-chars", "0", "--run-dir", "run"]
    result = shard(*args, cwd=where)
    assert result.returncode == 0, output(result)
    found = losses(where / "run")
    assert [step for step, _ in found] == list(range(1, STEPS + 1))
    return found


def test_killed_rank_restarts_and_losses_continue_exactly(
    uninterrupted: list[tuple[int, float]], tmp_path: Path
) -> None:
    """Kill at step 5: the restart resumes from step 3's checkpoint; every loss is the same."""
    args = [*TINY, "--steps", str(STEPS), "--sample-chars", "0", "--run-dir", "run"]
    result = shard(*args, "--max-restarts", "1", cwd=tmp_path, kill_at=5)
    assert result.returncode == 0, output(result)
    assert (
        "shard train: restart 1 after a rank failed: resuming from the checkpoint at step 3"
        in result.stderr
    ), output(result)
    assert "resuming at step 4" in result.stdout
    assert losses(tmp_path / "run") == uninterrupted
    info = read_info(tmp_path / "run" / "checkpoint")
    assert info is not None
    assert info.step == STEPS
    assert len(info.launch) == 32  # the launch that wrote it


def test_without_restarts_the_kill_ends_the_run_and_leaves_the_checkpoint_loadable(
    tmp_path: Path,
) -> None:
    """No --max-restarts: exit 1 naming rank 1; the step-3 checkpoint reads back whole.

    (``--resume`` from such a checkpoint continuing exactly is tested in
    ``test_train_end_to_end.py``; here every tensor is read back, in one process.)
    """
    args = [*TINY, "--steps", str(STEPS), "--sample-chars", "0", "--run-dir", "run"]
    killed = shard(*args, cwd=tmp_path, kill_at=5)
    assert killed.returncode == 1, output(killed)
    assert "shard train: stopped: rank 1 was killed by SIGKILL" in killed.stderr, output(killed)
    assert "last checkpoint: run/checkpoint (step 3, complete and loadable)" in killed.stderr
    assert "Traceback" not in killed.stderr
    assert [step for step, _ in losses(tmp_path / "run")][:3] == [1, 2, 3]
    full = consolidate(tmp_path / "run" / "checkpoint", tmp_path / "full.pt", fmt="torch")
    state = torch.load(full, weights_only=False)
    assert state["train.step"] == 3
    assert state["train.world_size"] == 2
    weights = [v for k, v in state.items() if k.startswith("model.")]
    moments = [v for k, v in state.items() if k.startswith("optim.") and "exp_avg" in k]
    assert weights
    assert moments
    assert all(bool(torch.isfinite(v).all()) for v in weights + moments)
