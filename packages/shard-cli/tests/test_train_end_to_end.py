"""``shard train`` end to end on two local CPU ranks: outputs, plan against measurement, resume.

One tiny run (9 steps, a checkpoint every 3) is shared by the tests of this
module; a second run is killed mid-way and resumed, and must reproduce the
first run's losses exactly.
"""

from __future__ import annotations

import json
import math
import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shard_cli import inspect_checkpoint
from shard_cli.__main__ import main
from shard_cli._plot import CHART_SIZE
from shard_cli._train_checkpoint import read_step

TINY = ["--preset", "tiny", "--batch", "4", "--seq", "32", "--ckpt-every", "3"]
STEPS = 9


@dataclass
class Run:
    run_dir: Path
    result: subprocess.CompletedProcess[str]

    @property
    def metrics(self) -> list[dict[str, Any]]:
        lines = (self.run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines]

    @property
    def summary(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.run_dir / "summary.json").read_text("utf-8"))
        return data


def shard(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shard_cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    where = tmp_path_factory.mktemp("train")
    result = shard(
        "train", *TINY, "--steps", str(STEPS), "--sample-chars", "40", "--run-dir", "run", cwd=where
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return Run(where / "run", result)


def test_train_prints_progress_summary_and_sample(run: Run) -> None:
    """Rank 0 prints progress lines, the memory and communication tables and a sample."""
    out = run.result.stdout
    assert "on 2 ranks (gloo, cpu), fully_shard, strategy full, fp32" in out
    assert f"step {STEPS}/{STEPS} [########################] loss" in out
    for heading in ("memory per rank (MiB)", "communication per step", "time per step", "sample:"):
        assert heading in out
    assert len((run.run_dir / "sample.txt").read_text(encoding="utf-8")) == len("def ") + 40 + 1


def test_metrics_file_has_every_step_and_the_loss_falls(run: Run) -> None:
    """metrics.jsonl holds one record per step, with finite losses that go down."""
    records = run.metrics
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert set(records[0]) == {"step", "loss", "lr", "tokens_per_s", "elapsed_s", "step_s"}
    losses = [r["loss"] for r in records]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.5


def test_plan_equals_measured_state_and_peak_is_within_ten_percent(run: Run) -> None:
    """Every rank holds exactly the bytes shard plan predicts; the peak is within 10%."""
    summary = run.summary
    predicted = summary["plan"]["ranks"]
    for measured, plan in zip(summary["ranks"], predicted, strict=True):
        for kind in ("params", "grads", "optim"):
            assert measured[kind] == plan[kind], (kind, measured, plan)
        assert abs(measured["peak"] - summary["plan"]["peak"]) <= 0.1 * measured["peak"]
    # Two ranks hold the model once between them, plus the padding of odd dims.
    together = sum(r["params"] for r in summary["ranks"])
    assert summary["unsharded"]["params"] <= together < 1.01 * summary["unsharded"]["params"]


def test_shard_plan_command_gives_the_numbers_train_measured(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    """``shard plan --json`` for the run's settings reports the same bytes as the run."""
    args = ["plan", "--preset", "tiny", "--batch", "4", "--seq", "32", "--world-size", "2"]
    assert main([*args, "--strategy", "full", "--json"]) == 0
    full = json.loads(capsys.readouterr().out)["strategies"]["full"]
    rank0 = run.summary["ranks"][0]
    assert [full["params"], full["grads"], full["optim"]] == [
        rank0["params"],
        rank0["grads"],
        rank0["optim"],
    ]
    assert full["peak"] == run.summary["plan"]["peak"]


def test_communication_per_step_is_two_gathers_and_one_reduction_per_unit(run: Run) -> None:
    """FULL_SHARD: 3 units gather in forward, the 2 blocks again in backward, 3 reduce.

    Counted bytes are the full (padded) buffers: a unit's parameters, as
    gathered, and its gradients, as reduce-scattered.
    """
    comm = run.summary["comm_per_step"]
    config = json.loads((run.run_dir / "model.json").read_text("utf-8"))["config"]
    d, vocab, seq = config["d_model"], config["vocab_size"], config["seq_len"]
    pad = lambda rows: 2 * math.ceil(rows / 2)  # noqa: E731 - rows after padding for 2 ranks
    block = 4 * (
        2 * pad(d) * 2  # two LayerNorms
        + pad(3 * d) * d
        + pad(3 * d)  # qkv
        + pad(d) * d
        + pad(d)  # attention projection
        + pad(4 * d) * d
        + pad(4 * d)  # fc
        + pad(d) * 4 * d
        + pad(d)  # mlp projection
    )
    root = 4 * (pad(vocab) * d + pad(seq) * d + 2 * pad(d) + pad(vocab) * d)
    assert comm["all_gather"] == {"calls": 5, "bytes": root + 4 * block}
    assert comm["reduce_scatter"] == {"calls": 3, "bytes": root + 2 * block}
    assert comm["all_reduce"] == {"calls": 0, "bytes": 0}


def _read_png(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, kinds, idat, size, channels = 8, [], b"", (0, 0), 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        assert struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])[0] == (
            zlib.crc32(kind + body) & 0xFFFFFFFF
        )
        kinds.append(kind)
        if kind == b"IHDR":
            size, channels = struct.unpack(">II", body[:8]), {2: 3, 6: 4}[body[9]]
        idat += body if kind == b"IDAT" else b""
        pos += 12 + length
    assert (kinds[0], kinds[-1]) == (b"IHDR", b"IEND")
    assert len(zlib.decompress(idat)) == size[1] * (1 + channels * size[0])
    return size


def test_training_png_is_a_valid_image(run: Run) -> None:
    """training.png is valid (signature, chunks, CRCs, rows) at its documented size."""
    assert _read_png((run.run_dir / "training.png").read_bytes()) == CHART_SIZE


def test_checkpoint_inspect_and_consolidate(run: Run, tmp_path: Path) -> None:
    """The run's checkpoint was written by 2 ranks at the last step and consolidates."""
    ckpt = run.run_dir / "checkpoint"
    info = inspect_checkpoint(ckpt)
    assert info.world_size == 2
    assert read_step(ckpt) == STEPS
    model_keys = {e.key for e in info.entries if e.key.startswith("model.")}
    assert "model.blocks.1.mlp.fc.weight" in model_keys
    out = tmp_path / "model.safetensors"
    result = shard("ckpt", "consolidate", str(ckpt), str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    header_len = struct.unpack("<Q", out.read_bytes()[:8])[0]
    header = json.loads(out.read_bytes()[8 : 8 + header_len])
    assert {f"model.{k}" for k in header if k != "__metadata__"} == model_keys


def _rank_pids(launcher: int) -> dict[int, int]:
    """The launcher's rank processes by RANK, read from /proc."""
    ranks: dict[int, int] = {}
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    for pid in map(int, children):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        for item in environ:
            if item.startswith(b"RANK="):
                ranks[int(item[5:])] = pid
    return ranks


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    """Until ``path`` exists; fail with the run's output if it ends or takes too long first."""
    deadline = time.monotonic() + timeout
    while not path.is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"no {path} from the run: {out[-2000:]}{err[-2000:]}")
        time.sleep(0.05)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds ranks through /proc")
def test_killed_rank_stops_every_rank_and_resume_continues_exactly(
    run: Run, tmp_path: Path
) -> None:
    """SIGKILL one rank: all stop, the last checkpoint loads, and --resume gives the same losses."""
    args = [*TINY, "--steps", "400", "--sample-chars", "0", "--run-dir", "run"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "shard_cli", "train", *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    run_dir = tmp_path / "run"
    _wait_for(run_dir / "checkpoint" / "step-3" / ".metadata", proc)
    ranks = _rank_pids(proc.pid)
    os.kill(ranks[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "shard train: stopped: rank 1 was killed by SIGKILL" in err
    step = read_step(run_dir / "checkpoint")
    assert step is not None
    assert step % 3 == 0
    assert f"last checkpoint: run/checkpoint (step {step}, complete; " in err
    assert "continue with: shard train --resume --run-dir run" in err
    for pid in ranks.values():
        assert not Path(f"/proc/{pid}").exists()
    resumed = shard("train", "--resume", "--run-dir", "run", "--steps", str(STEPS), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"resuming at step {step + 1}" in resumed.stdout
    losses = [
        json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert losses == [r["loss"] for r in run.metrics]
