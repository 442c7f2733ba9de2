"""``shard train``'s training options end to end: schedule, clipping, accumulation, checkpointing.

Each run's losses, learning rates and pre-clip gradient norms equal, within
fp32 round-off, those of one plain PyTorch process that trains the same GPT
(same seed) on every rank's batches at once, with ``torch.nn.utils.clip_grad_norm_``
and the same learning rate per step, and without activation checkpointing or
gradient accumulation: its batch per rank is the ``--grad-accum K`` micro-batches
of ``--batch B`` together (``K * B`` rows in one forward), so the match also
shows that accumulating K micro-batches trains as one batch of ``K * B``.

Three launches keep the suite fast: ``fully_shard`` on two ranks from a
``--config`` file (a ``.bin`` of uint32 tokens, cosine schedule, clipping,
accumulation, activation checkpointing, TensorBoard; killed at step 5 and
restarted from its step-3 checkpoint, so resuming is checked too), the
wrapper front end on two ranks (text, warmup, clipping, accumulation,
activation checkpointing), and ``--compile`` on one rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shard_cli import CharCorpus, TrainOptions
from shard_cli._corpus import TokenFile, load_data
from shard_cli._schedule import lr_at
from shard_cli._train import model_config
from shard_cli.gpt import GPT

SEED = 0
TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen jugs.\n" * 20

CONFIG = """\
# Every key is a flag of shard train; --steps on the command line wins over steps here.
preset = "tiny"
layers = 1
d_model = 32
batch = 2
seq = 16
steps = 4
lr = 0.01
seed = 0
data = "tokens.bin"
data_dtype = "uint32"
grad_accum = 2
lr_schedule = "cosine"
warmup_steps = 2
min_lr = 0.001
clip_grad_norm = 0.5
activation_checkpointing = true
tensorboard = true
ckpt_every = 3
max_restarts = 1
sample_chars = 0
run_dir = "run"
nproc_per_node = 2
"""


@dataclass(frozen=True)
class Reference:
    losses: list[float]
    lrs: list[float]
    norms: list[float]


def _reference(
    corpus: CharCorpus | TokenFile,
    *,
    ranks: int,
    steps: int,
    batch: int,
    accum: int,
    lr: float,
    warmup: int = 0,
    schedule: str = "constant",
    min_lr: float = 0.0,
    clip: float | None = None,
) -> Reference:
    """One process, every rank's whole step batch in one forward, torch's clipping, AdamW."""
    options = TrainOptions(preset="tiny", n_layers=1, d_model=32, seq=16, batch=batch, lr=lr)
    torch.manual_seed(SEED)
    model = GPT(model_config(options, corpus.vocab_size))
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    out = Reference([], [], [])
    for step in range(1, steps + 1):
        rate = lr_at(
            step, lr=lr, steps=steps, warmup_steps=warmup, schedule=schedule, min_lr=min_lr
        )
        for group in optim.param_groups:
            group["lr"] = rate
        pairs = [
            corpus.batch(step=step, rank=r, batch=batch * accum, seq=16, seed=SEED)
            for r in range(ranks)
        ]
        x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
        logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()  # type: ignore[no-untyped-call]
        if clip is not None:
            out.norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optim.step()
        optim.zero_grad(set_to_none=True)
        out.losses.append(float(loss.detach()))
        out.lrs.append(rate)
    return out


def _shard_train(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "shard_cli", "train", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def _summary(run_dir: Path) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    return summary


@dataclass(frozen=True)
class Launch:
    where: Path
    result: subprocess.CompletedProcess[str]

    @property
    def run_dir(self) -> Path:
        return self.where / "run"


@pytest.fixture(scope="module")
def config_run(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """fully_shard on 2 ranks from cfg.toml, killed at step 5, restarted from step 3."""
    where = tmp_path_factory.mktemp("config_run")
    # A sequence the model can learn, ids 0..59 stored as uint32.
    ids = (np.arange(3000) * 7 % 60).astype(np.uint32)
    ids.tofile(where / "tokens.bin")
    (where / "cfg.toml").write_text(CONFIG, encoding="utf-8")
    result = _shard_train(
        where, "--config", "cfg.toml", "--steps", "6", env={"SHARD_TRAIN_TEST_KILL_AT_STEP": "5"}
    )
    return Launch(where, result)


def test_config_run_matches_one_process_through_a_restart(config_run: Launch) -> None:
    """Two ranks under cosine warmup, clipping, 2 micro-batches and activation checkpointing,
    killed at step 5 and resumed from step 3, give one process's losses, rates and norms."""
    assert "restart 1 after a rank failed: resuming from the checkpoint at step 3" in (
        config_run.result.stderr
    )
    tokens = load_data(str(config_run.where / "tokens.bin"), "uint32")
    expected = _reference(
        tokens,
        ranks=2,
        steps=6,
        batch=2,
        accum=2,
        lr=0.01,
        warmup=2,
        schedule="cosine",
        min_lr=0.001,
        clip=0.5,
    )
    records = _metrics(config_run.run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["lr"] for r in records] == expected.lrs
    assert [r["loss"] for r in records] == pytest.approx(expected.losses, rel=1e-5, abs=1e-6)
    assert [r["grad_norm"] for r in records] == pytest.approx(expected.norms, rel=1e-4)
    assert max(expected.norms) > 0.5  # clipping changed the update
    assert records[-1]["loss"] < records[0]["loss"]
    # Reduced once per step (block and root), on the last micro-batch only.
    assert _summary(config_run.run_dir)["comm_per_step"]["reduce_scatter"]["calls"] == 2


def test_config_file_values_and_command_line_override_reach_config_json(
    config_run: Launch,
) -> None:
    """config.json holds the file's options, with --steps 6 from the command line over steps = 4."""
    stored = json.loads((config_run.run_dir / "config.json").read_text(encoding="utf-8"))
    assert stored == {
        **TrainOptions().to_json(),
        "preset": "tiny",
        "n_layers": 1,
        "d_model": 32,
        "batch": 2,
        "seq": 16,
        "steps": 6,
        "lr": 0.01,
        "seed": 0,
        "data": "tokens.bin",
        "data_dtype": "uint32",
        "grad_accum": 2,
        "lr_schedule": "cosine",
        "warmup_steps": 2,
        "min_lr": 0.001,
        "clip_grad_norm": 0.5,
        "activation_checkpointing": True,
        "tensorboard": True,
        "ckpt_every": 3,
        "max_restarts": 1,
        "sample_chars": 0,
        "run_dir": "run",
        "nproc": 2,
        # The restarted ranks resumed; config.json is rewritten by them.
        "resume": True,
    }
    banner = "2 micro-batches per step, lr cosine, 2 warmup steps, gradients clipped to norm 0.5"
    assert banner in config_run.result.stdout


def test_tensorboard_events_hold_every_step_of_metrics_jsonl(config_run: Launch) -> None:
    """RUN_DIR/tensorboard holds train/loss, train/lr and train/grad_norm as metrics.jsonl."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(config_run.run_dir / "tensorboard"))
    events.Reload()
    records = _metrics(config_run.run_dir)
    for name in ("loss", "lr", "grad_norm"):
        # The first attempt logged steps 1-4, the restart 4-6 again: the last value per step wins.
        logged = {e.step: e.value for e in events.Scalars(f"train/{name}")}
        assert sorted(logged) == [1, 2, 3, 4, 5, 6]
        assert [logged[r["step"]] for r in records] == pytest.approx(
            [r[name] for r in records], rel=1e-6
        )


def test_wrapper_with_accumulation_clipping_and_checkpointing_matches_one_process(
    tmp_path: Path,
) -> None:
    """The wrapper front end (no_sync on the first micro-batch, its clip_grad_norm_) on 2 ranks,
    with warmup and activation checkpointing, gives one process's losses and norms."""
    (tmp_path / "data.txt").write_text(TEXT, encoding="utf-8")
    _shard_train(
        tmp_path,
        *("--preset", "tiny", "--layers", "1", "--d-model", "32", "--seq", "16"),
        *("--batch", "2", "--steps", "4", "--lr", "0.01", "--data", "data.txt"),
        *("--frontend", "wrapper", "--grad-accum", "2", "--warmup-steps", "2"),
        *("--clip-grad-norm", "0.5", "--activation-checkpointing"),
        *("--sample-chars", "0", "--run-dir", "run"),
    )
    corpus = CharCorpus.from_text(TEXT, ascii_only=False)
    expected = _reference(corpus, ranks=2, steps=4, batch=2, accum=2, lr=0.01, warmup=2, clip=0.5)
    records = _metrics(tmp_path / "run")
    assert [r["lr"] for r in records] == expected.lrs == [0.005, 0.01, 0.01, 0.01]
    assert [r["loss"] for r in records] == pytest.approx(expected.losses, rel=1e-5, abs=1e-6)
    assert [r["grad_norm"] for r in records] == pytest.approx(expected.norms, rel=1e-4)
    assert _summary(tmp_path / "run")["comm_per_step"]["reduce_scatter"]["calls"] == 2


def test_compiled_blocks_train_as_eager_ones(tmp_path: Path) -> None:
    """--compile (each block through torch.compile) on one rank gives the eager process's losses."""
    (tmp_path / "data.txt").write_text(TEXT, encoding="utf-8")
    result = _shard_train(
        tmp_path,
        *("--preset", "tiny", "--layers", "1", "--d-model", "32", "--seq", "16"),
        *("--batch", "2", "--steps", "2", "--lr", "0.01", "--data", "data.txt"),
        *("--nproc-per-node", "1", "--compile", "--sample-chars", "0", "--run-dir", "run"),
    )
    assert "compiled blocks" in result.stdout
    corpus = CharCorpus.from_text(TEXT, ascii_only=False)
    expected = _reference(corpus, ranks=1, steps=2, batch=2, accum=1, lr=0.01)
    losses = [r["loss"] for r in _metrics(tmp_path / "run")]
    assert losses == pytest.approx(expected.losses, rel=1e-4)
