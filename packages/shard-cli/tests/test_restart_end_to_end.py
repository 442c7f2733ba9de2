"""``shard train --max-restarts``: a killed rank, rank 0 included, restarts the job exactly.

Two local CPU ranks train the tiny preset for 8 steps on a fixed copy of
shard's sources (``--data``): the sources themselves may be edited while the
tests run, and a run whose data changes between its launch and a restart
trains on other batches ([Note: batches from the step alone] in
``_corpus.py``; that was the cause of a flake here). A rank SIGKILLs itself
at a chosen point of a step (``SHARD_TRAIN_TEST_KILL_AT_STEP``, see
``_kill_switch.py``).

With ``--max-restarts 3`` rank 0, whose death used to take the c10d store
along, dies in step 3's forward, then in the first restart in step 5's
backward, then in step 7's optimizer step: each time rank 1 names it and the
collective it was last seen in (phase and step, the step as the progress
line shows it), and the run ends with the uninterrupted run's losses bit for
bit. Without ``--max-restarts`` rank 1 dies as the checkpoint of step 6 is
due, so rank 0 fails in the save's own collectives (not shard's): ``shard
train`` exits 1 naming it, rank 0's diagnosis still reaches the console, and
the checkpoint of step 3 reads back whole. (That a restart never takes a checkpoint an
earlier launch left in the run directory is tested in ``test_restart.py``.)
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
from shard_cli._corpus import load_corpus
from shard_cli._train_checkpoint import read_info

STEPS = 8
# Short waits for the dead rank's record: the restarts are what these tests time.
WAITS = {"SHARD_FLIGHT_WAIT": "1", "SHARD_SIGTERM_GRACE_S": "1"}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """shard's sources as they are now, in a file no one edits."""
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(load_corpus().text, encoding="utf-8")
    return path


def shard(
    *args: str, cwd: Path, data: Path, kill: str | None = None, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **WAITS}
    env.pop("SHARD_TRAIN_TEST_KILL_AT_STEP", None)
    if kill is not None:
        env["SHARD_TRAIN_TEST_KILL_AT_STEP"] = kill
    tiny = ["--preset", "tiny", "--batch", "4", "--seq", "32", "--sample-chars", "0"]
    # Profile the last step only: the attempts that are killed then never start the profiler.
    tiny += ["--measure-step", str(STEPS)]
    return subprocess.run(
        [sys.executable, "-m", "shard_cli", "train", *tiny, "--data", str(data), *args],
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
    return result.stdout[-3000:] + result.stderr[-6000:]


def reports(stderr: str, survivor: int) -> list[list[str]]:
    """Each report the survivor wrote on SIGTERM (after a failed collective, or before one)."""
    found: list[list[str]] = []
    for line in stderr.splitlines():
        if line.startswith(f"shard: rank {survivor} of 2 was stopped by SIGTERM"):
            found.append([line])
        elif found and line.startswith("  "):
            found[-1].append(line)
    return found


def assert_names_the_dead_rank(report: list[str], dead: int, last_seen: str) -> None:
    """The dead rank did not answer, and was last seen in ``last_seen`` (phase, step, seq).

    These two lines are the same whether the survivor's collective failed
    before the launcher's SIGTERM came or the SIGTERM came first.
    """
    text = "\n".join(report)
    assert (
        f"  did not answer: rank {dead} (dead, or stuck outside a collective; no record in "
        "the c10d store after up to 1 s (SHARD_"
    ) in text, text
    assert (
        f"  rank {dead} was last seen in the {last_seen}, the last collective it completed "
        "with this rank"
    ) in text, text


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, data: Path) -> list[tuple[int, float]]:
    where = tmp_path_factory.mktemp("uninterrupted")
    result = shard("--steps", str(STEPS), "--run-dir", "run", cwd=where, data=data)
    assert result.returncode == 0, output(result)
    found = losses(where / "run")
    assert [step for step, _ in found] == list(range(1, STEPS + 1))
    return found


def test_rank_0_killed_in_forward_backward_and_optimizer_restarts_with_the_same_losses(
    uninterrupted: list[tuple[int, float]], tmp_path: Path, data: Path
) -> None:
    """Three deaths of rank 0, three restarts from the last checkpoint, the same losses."""
    kills = "0:3:forward,0:5:backward,0:7:optimizer"
    args = ["--steps", str(STEPS), "--ckpt-every", "2", "--run-dir", "run", "--max-restarts", "3"]
    result = shard(*args, cwd=tmp_path, data=data, kill=kills)
    assert result.returncode == 0, output(result)
    notes = [line for line in result.stderr.splitlines() if "restart" in line]
    assert notes == [
        f"shard train: restart {n} after a rank failed: resuming from the checkpoint at step "
        f"{step} (run/checkpoint)"
        for n, step in ((1, 2), (2, 4), (3, 6))
    ], output(result)
    forward, backward, optimizer = reports(result.stderr, survivor=1)
    assert_names_the_dead_rank(
        forward, 0, "all-gather of `blocks.0` (forward all-gather, step 3, seq 17)"
    )
    assert_names_the_dead_rank(
        backward, 0, "all-gather of `blocks.1` (forward all-gather, step 5, seq 18)"
    )
    assert_names_the_dead_rank(
        optimizer, 0, "reduce-scatter of `GPT` (reduce-scatter, step 7, seq 23)"
    )
    assert losses(tmp_path / "run") == uninterrupted
    info = read_info(tmp_path / "run" / "checkpoint")
    assert info is not None
    assert info.step == STEPS
    assert len(info.launch) == 32  # the launch that wrote it


def test_without_restarts_the_kill_ends_the_run_names_the_rank_and_leaves_the_checkpoint(
    tmp_path: Path, data: Path
) -> None:
    """No --max-restarts, rank 1 killed before the step-6 save: exit 1 naming it, its
    survivor says where it was last seen; the step-3 checkpoint reads back whole.

    (``--resume`` from such a checkpoint continuing exactly is tested in
    ``test_train_end_to_end.py``; here every tensor is read back, in one process.)
    """
    args = ["--steps", str(STEPS), "--ckpt-every", "3", "--run-dir", "run"]
    killed = shard(*args, cwd=tmp_path, data=data, kill="1:6:save")
    assert killed.returncode == 1, output(killed)
    assert (
        "shard train: stopped: rank 1 was killed by SIGKILL (then rank 0 was killed by "
        "SIGTERM); every rank was stopped." in killed.stderr
    ), output(killed)
    assert "last checkpoint: run/checkpoint (step 3, complete; " in killed.stderr
    assert "Traceback" not in killed.stderr
    (report,) = reports(killed.stderr, survivor=0)
    assert_names_the_dead_rank(report, 1, "all-reduce of `loss` (end of step, step 6, seq 5)")
    assert [step for step, _ in losses(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]
    full = consolidate(tmp_path / "run" / "checkpoint", tmp_path / "full.pt", fmt="torch")
    state = torch.load(full, weights_only=False)
    assert state["train.step"] == 3
    assert state["train.world_size"] == 2
    weights = [v for k, v in state.items() if k.startswith("model.")]
    moments = [v for k, v in state.items() if k.startswith("optim.") and "exp_avg" in k]
    assert weights
    assert moments
    assert all(bool(torch.isfinite(v).all()) for v in weights + moments)
