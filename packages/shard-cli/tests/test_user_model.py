"""``shard train`` on the user's own model (``--model``, ``--hf-config``) and text (``--data``).

Each model trains a few steps on two ranks; its losses equal, within fp32
round-off, those of one plain PyTorch process that trains the same model
(same seed) on the two ranks' batches together with AdamW. A transformers
model is built on the meta device and initialised module by module from
``(seed, module name)`` (``shard_cli._materialise``), so the reference
initialises its unsharded model with the same function.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shard_cli import CharCorpus
from shard_cli.__main__ import main as shard_main
from shard_cli._materialise import hf_module_init, materialise, parameters_on_meta

STEPS, BATCH, SEQ, LR, SEED = 4, 4, 16, 1e-2, 0
TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen jugs.\n" * 20

FACTORY = """
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def factory() -> nn.Module:
    return Tiny()
"""

LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 40,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def _train(cwd: Path, *args: str, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cwd), *sys.path])}
    return subprocess.run(
        [
            *(sys.executable, "-m", "shard_cli", "train", "--nproc-per-node", str(nproc)),
            *("--steps", str(STEPS), "--batch", str(BATCH), "--seq", str(SEQ), "--lr", str(LR)),
            *("--sample-chars", "0", "--data", "data.txt", "--run-dir", "r", *args),
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["loss"] for line in lines]


def _reference(
    build: Callable[[], nn.Module],
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    steps: int = STEPS,
) -> list[float]:
    """One process: the same model and seed, both ranks' batches in one, AdamW."""
    corpus = CharCorpus.from_text(TEXT, ascii_only=False)
    torch.manual_seed(SEED)
    model = build()
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(1, steps + 1):
        pairs = [corpus.batch(step=step, rank=r, batch=BATCH, seq=SEQ, seed=SEED) for r in (0, 1)]
        x = torch.cat([p[0] for p in pairs])
        y = torch.cat([p[1] for p in pairs])
        out = logits(model, x)
        loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()  # type: ignore[no-untyped-call]
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "data.txt").write_text(TEXT, encoding="utf-8")
    package = tmp_path / "tests_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("", encoding="utf-8")
    (package / "mod.py").write_text(FACTORY.replace("VOCAB", "48"), encoding="utf-8")
    (package / "small.py").write_text(FACTORY.replace("VOCAB", "8"), encoding="utf-8")
    return tmp_path


def test_model_factory_on_two_ranks_matches_one_process_and_resumes(
    work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--model tests_pkg.mod:factory with --data: two ranks' losses, resumed from step 4 to 6,
    equal one process's; resuming with another --model is refused."""
    result = _train(work, "--model", "tests_pkg.mod:factory")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "tests_pkg.mod:factory()" in result.stdout
    run_dir = str(work / "r")
    assert shard_main(["train", "--resume", "--run-dir", run_dir, "--model", "x:y"]) == 2
    assert "--model x:y differs from the interrupted run's tests_pkg.mod:factory" in (
        capsys.readouterr().err
    )
    resumed = _train(work, "--resume", "--steps", "6")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    sys.path.insert(0, str(work))
    try:
        from tests_pkg.mod import factory  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(work))
    expected = _reference(factory, lambda m, x: m(x), steps=6)
    assert _losses(work / "r") == pytest.approx(expected, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(("tied", "frontend"), [(True, "fully_shard"), (False, "wrapper")])
def test_hf_config_on_two_ranks_matches_one_process(work: Path, tied: bool, frontend: str) -> None:
    """--hf-config (a tiny Llama config.json, its embeddings tied or not) with --data: built on
    the meta device and initialised per module, two ranks' losses equal one process's that
    initialises the unsharded model the same way."""
    transformers = pytest.importorskip("transformers")
    (work / "llama").mkdir()
    config_json = {**LLAMA, "tie_word_embeddings": tied}
    (work / "llama" / "config.json").write_text(json.dumps(config_json), encoding="utf-8")
    result = _train(work, "--hf-config", "llama/config.json", "--frontend", frontend)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    config = transformers.AutoConfig.from_pretrained(str(work / "llama" / "config.json"))

    def build() -> nn.Module:
        with parameters_on_meta():
            model: nn.Module = transformers.AutoModelForCausalLM.from_config(config)
        materialise(model, device=torch.device("cpu"), seed=SEED, init=hf_module_init)
        head, embed = model.lm_head.weight, model.model.embed_tokens.weight
        assert (head is embed) == tied
        return model

    expected = _reference(build, lambda m, x: m(x).logits)
    assert _losses(work / "r") == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_model_with_a_smaller_vocabulary_than_the_data_is_refused_before_launch(
    work: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model of 8 logits on text of more characters exits 2, naming both sizes, no rank run."""
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))
    code = shard_main(["train", "--model", "tests_pkg.small:factory", "--data", "data.txt"])
    vocab = CharCorpus.from_text(TEXT, ascii_only=False).vocab_size
    assert code == 2
    assert capsys.readouterr().err == (
        f"shard train: tests_pkg.small:factory() has a vocabulary of 8 tokens but the data "
        f"(data.txt) has {vocab}; give the model a vocabulary of at least {vocab} (vocab_size "
        "in its config or factory)\n"
    )
    assert not (work / "runs").exists()
