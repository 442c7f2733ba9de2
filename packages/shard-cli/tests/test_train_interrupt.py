"""Ctrl-C stops ``shard train`` on every rank with a clear message and a loadable checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shard_cli import inspect_checkpoint
from shard_cli._train_checkpoint import read_step


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    """Until ``path`` exists; fail with the run's output if it ends or takes too long first."""
    deadline = time.monotonic() + timeout
    while not path.is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"no {path} from the run: {out[-2000:]}{err[-2000:]}")
        time.sleep(0.05)


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="sends SIGINT to a process group")
def test_ctrl_c_stops_every_rank_and_names_the_last_checkpoint(tmp_path: Path) -> None:
    """SIGINT to the launcher's process group (what a terminal's Ctrl-C does): exit 130."""
    args = ["--preset", "tiny", "--batch", "4", "--seq", "32", "--steps", "400"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "shard_cli", "train", *args, "--ckpt-every", "2", "--run-dir", "r"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    _wait_for(tmp_path / "r" / "checkpoint" / "step-2" / ".metadata", proc)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "shard train: interrupted during step" in out
    assert "shard train: stopped: interrupted (Ctrl-C); every rank was stopped." in err
    step = read_step(tmp_path / "r" / "checkpoint")
    assert step is not None
    assert step % 2 == 0
    assert f"last checkpoint: r/checkpoint (step {step}, complete; " in err
    assert "Traceback" not in err
    assert inspect_checkpoint(tmp_path / "r" / "checkpoint").world_size == 2
