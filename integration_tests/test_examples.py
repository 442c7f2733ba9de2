"""The scripts in ``examples/`` run as their docstrings say and do what they claim.

Each runs as a user runs it, under ``torchrun`` on two CPU ranks (one
subprocess per script run, like test_frameworks.py; the rank pool cannot
run a script's ``main``), and the fully_shard Llama also as one plain
``python`` process. Checked: the Llama exported by either front end loads
in ``transformers`` with ``from_pretrained`` and gives the trained sharded
model's logits exactly; the wrapper's losses equal fully_shard's, and one
process's equal two ranks'; the PyTorch FSDP2 script and its shard twin
differ only in their import lines and print identical losses step by step.
(``examples/frameworks`` has its own test, test_frameworks.py.)
"""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
STEPS = 4


def _run(script: str, out: Path, *, ranks: int | None = 2) -> list[float]:
    """Run ``examples/<script>`` (torchrun with ``ranks``, or plain python); its losses."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    launcher = [sys.executable]
    if ranks is not None:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    result = subprocess.run(
        [*launcher, str(EXAMPLES / script), "--steps", str(STEPS), "--out", str(out)],
        cwd=out.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    losses: list[float] = json.loads((out / "losses.json").read_text(encoding="utf-8"))
    assert len(losses) == STEPS
    printed = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(printed) == STEPS  # rank 0 alone prints
    return losses


@pytest.fixture(scope="module")
def fully_shard_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """examples/llama/train_fully_shard.py on two ranks, run once for the tests below."""
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("llama") / "fully_shard"
    return out, _run("llama/train_fully_shard.py", out)


def _assert_transformers_reproduces(out: Path) -> None:
    """``from_pretrained(out/hf)`` gives the logits the sharded model computed, exactly."""
    import transformers

    saved = torch.load(out / "logits.pt", weights_only=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the ranks (OMP_NUM_THREADS=1): the same kernels' order
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
        with torch.no_grad():
            logits = model(input_ids=saved["prompt"]).logits
    finally:
        torch.set_num_threads(threads)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert logits.shape == (1, saved["prompt"].shape[1], 256)
    assert torch.equal(logits, saved["logits"])


def test_llama_fully_shard_trains_checkpoints_and_exports_for_transformers(
    fully_shard_run: tuple[Path, list[float]],
) -> None:
    """Two ranks learn (the loss falls), write a DCP checkpoint with every rank's shard, and
    export weights that transformers loads into a model with the trained logits exactly."""
    out, losses = fully_shard_run
    assert losses[-1] < losses[0]
    checkpoint = out / "checkpoint"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        ".checksums",
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    _assert_transformers_reproduces(out)


def test_llama_fully_shard_one_process_matches_two_ranks(
    fully_shard_run: tuple[Path, list[float]], tmp_path: Path
) -> None:
    """Plain ``python`` (a world of one) trains the same global batch to two ranks' losses."""
    _, two_ranks = fully_shard_run
    one = _run("llama/train_fully_shard.py", tmp_path / "one", ranks=None)
    assert one == pytest.approx(two_ranks, rel=1e-5)


def test_llama_wrapper_matches_fully_shard_and_exports(
    fully_shard_run: tuple[Path, list[float]], tmp_path: Path
) -> None:
    """The wrapper front end on two ranks: fully_shard's losses, and an export transformers
    loads with the trained logits exactly."""
    _, expected = fully_shard_run
    out = tmp_path / "wrapper"
    assert _run("llama/train_wrapper.py", out) == pytest.approx(expected, rel=1e-5)
    _assert_transformers_reproduces(out)


def test_switch_from_pytorch_differs_only_in_imports() -> None:
    """fsdp2_shard.py is fsdp2_pytorch.py with PyTorch's FSDP imports replaced by shard's."""
    folder = EXAMPLES / "switch_from_pytorch"
    torch_lines = (folder / "fsdp2_pytorch.py").read_text(encoding="utf-8").splitlines()
    shard_lines = (folder / "fsdp2_shard.py").read_text(encoding="utf-8").splitlines()
    diff = [
        line
        for line in difflib.unified_diff(torch_lines, shard_lines, lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert diff == [
        "-from torch.distributed.checkpoint.state_dict import get_model_state_dict, "
        "get_optimizer_state_dict",
        "-from torch.distributed.fsdp import fully_shard",
        "+from shard_checkpoint import get_model_state_dict, get_optimizer_state_dict",
        "+from shard_runtime import fully_shard",
    ]


def test_switch_from_pytorch_prints_pytorchs_losses(tmp_path: Path) -> None:
    """On two ranks, the shard twin's losses equal PyTorch FSDP2's, step by step, exactly."""
    torch_losses = _run("switch_from_pytorch/fsdp2_pytorch.py", tmp_path / "torch")
    shard_losses = _run("switch_from_pytorch/fsdp2_shard.py", tmp_path / "shard")
    assert shard_losses == torch_losses
    assert shard_losses[-1] < shard_losses[0]
    for out in (tmp_path / "torch", tmp_path / "shard"):
        assert (out / "checkpoint" / ".metadata").is_file()
