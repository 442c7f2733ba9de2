"""Real frameworks run on shard unchanged: Lightning Fabric, Hugging Face accelerate, torchtitan.

Each test launches one of ``examples/frameworks/`` once on two gloo ranks
with ``--impl both``: the framework trains the same model on PyTorch's
``fully_shard`` and then, after ``use_shard_for_torch_fsdp()``, on shard's,
saves a checkpoint halfway and resumes from it. The frameworks launch their
own way (torchrun), so this is one subprocess per framework rather than
shard_testing's rank pool.

Losses are compared exactly: fp32 on the CPU, two ranks, and the same
arithmetic in both implementations (gather, compute, sum of two gradients
divided by two, or by the global token count for torchtitan), so any
difference is a real one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shard_runtime import FSDPModule

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "frameworks"
STEPS = 6
HALF = STEPS // 2
# TinyModel in examples/frameworks/_common.py: three blocks and the root, one reduce-scatter each.
UNITS = 4
# The class fully_shard gives the root module: which implementation sharded it.
MODEL_CLASS = {
    "torch": "torch.distributed.fsdp._fully_shard._fsdp_init.FSDP",
    "shard": f"{FSDPModule.__module__}.FSDP",
}


def _require(distribution: str) -> None:
    # find_spec, not importorskip: importing lightning here would cost seconds for nothing.
    if importlib.util.find_spec(distribution) is None:
        pytest.skip(f"{distribution} is not installed (the dev environment has it)")


def _launch(script: str, tmp_path: Path) -> dict[str, Any]:
    """Run ``examples/frameworks/<script>`` on two CPU ranks with ``--impl both``; its JSON."""
    out = tmp_path / "results.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(EXAMPLES / script),
        "--impl",
        "both",
        "--steps",
        str(STEPS),
        "--workdir",
        str(tmp_path),
        "--out",
        str(out),
    ]
    result = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    results: dict[str, Any] = json.loads(out.read_text())
    assert sorted(results) == ["shard", "torch"]
    for impl, run in results.items():
        assert run["model_class"].startswith(MODEL_CLASS[impl]), (impl, run["model_class"])
        assert run["sharded_by_selected"], impl
    return results


def test_fabric_model_parallel(tmp_path: Path) -> None:
    """Fabric ModelParallelStrategy: PyTorch's losses, no_backward_sync reduces nothing, resume."""
    _require("lightning")
    results = _launch("fabric_model_parallel.py", tmp_path)
    torch_run, shard_run = results["torch"], results["shard"]
    assert torch_run["fsdp_module"] == "torch.distributed.fsdp.FSDPModule"
    assert shard_run["fsdp_module"] == f"{FSDPModule.__module__}.{FSDPModule.__qualname__}"

    assert [s["step"] for s in shard_run["steps"]] == list(range(STEPS))
    assert [s["losses"] for s in shard_run["steps"]] == [s["losses"] for s in torch_run["steps"]]
    for run in (torch_run, shard_run):
        # The first micro-batch runs under fabric.no_backward_sync: its backward dispatches no
        # reduction at all; the second reduces every unit once.
        assert [s["reductions"] for s in run["steps"] + run["resumed"]] == [[0, UNITS]] * (
            STEPS + STEPS - HALF
        )
        # fabric.load into a fresh model (built on the meta device) and optimizer continues
        # exactly where training went on.
        assert run["resumed_on_meta"]
        assert run["resumed"] == run["steps"][HALF:]


def test_accelerate_fsdp2(tmp_path: Path) -> None:
    """accelerate's FSDP2 plugin: shard's losses equal PyTorch's; load_state resumes exactly."""
    _require("accelerate")
    results = _launch("accelerate_fsdp2.py", tmp_path)
    torch_run, shard_run = results["torch"], results["shard"]
    for run in (torch_run, shard_run):
        assert run["units"] == UNITS  # transformer_based_wrap on Block, then the root
        assert len(run["losses"]) == STEPS
        assert run["resumed"] == run["losses"][HALF:]
    assert shard_run["losses"] == torch_run["losses"]


def test_torchtitan_llama3(tmp_path: Path) -> None:
    """torchtitan's llama3 parallelize and step: losses and grad norms equal PyTorch's; resume.

    torchtitan binds FSDPModule at import and sets every unit's gradient
    divide factor to 1.0; a grad norm equal to PyTorch's shows shard's units
    were reached (unreached, shard averages and the norm halves).
    """
    _require("torchtitan")
    results = _launch("torchtitan_llama3.py", tmp_path)
    torch_run, shard_run = results["torch"], results["shard"]
    assert len(torch_run["steps"]) == STEPS
    assert shard_run["steps"] == torch_run["steps"]
    for run in (torch_run, shard_run):
        assert run["resumed"] == run["steps"][HALF:]
