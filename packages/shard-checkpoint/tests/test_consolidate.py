"""consolidate in one process: dtypes, prefixes, the .old fallback, and refusals."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from shard_checkpoint import CheckpointError, consolidate, save
from shard_checkpoint._safetensors import read_safetensors


def _model_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(6, 4, generator=g).bfloat16(),
        "norm.weight": torch.randn(4, generator=g),
        "norm.steps": torch.tensor(12),
        "head.scale": torch.tensor(0.5, dtype=torch.float64),
    }


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_model_prefix_gives_the_model_state_dict(tmp_path: Path, fmt: str) -> None:
    """bf16, int and 0-d tensors under 'model.' come out under their own names, bit for bit."""
    save({"model": _model_state(), "epoch": 3}, checkpoint_id=tmp_path / "ckpt")
    out = consolidate(tmp_path / "ckpt", tmp_path / "out", fmt=fmt, prefix="model.")  # type: ignore[arg-type]
    assert out == tmp_path / "out"
    if fmt == "safetensors":
        tensors, _ = read_safetensors(out)
    else:
        tensors = torch.load(out, weights_only=True)
    assert sorted(tensors) == sorted(_model_state())
    for key, value in _model_state().items():
        assert tensors[key].dtype == value.dtype
        assert torch.equal(tensors[key], value), key


def test_torch_format_keeps_non_tensor_values(tmp_path: Path) -> None:
    """fmt='torch' without a prefix keeps every flat key, plain values included."""
    save({"model": _model_state(), "epoch": 3}, checkpoint_id=tmp_path / "ckpt")
    loaded = torch.load(consolidate(tmp_path / "ckpt", tmp_path / "all.pt", fmt="torch"))
    assert loaded["epoch"] == 3
    assert torch.equal(loaded["model.norm.steps"], torch.tensor(12))


def test_consolidate_reads_the_old_checkpoint_after_an_interrupted_swap(tmp_path: Path) -> None:
    """With only <id>.old left by an interrupted save, consolidate reads it."""
    save({"model": _model_state()}, checkpoint_id=tmp_path / "ckpt")
    (tmp_path / "ckpt").rename(tmp_path / "ckpt.old")
    tensors, _ = read_safetensors(consolidate(tmp_path / "ckpt", tmp_path / "m.safetensors"))
    assert torch.equal(tensors["model.norm.weight"], _model_state()["norm.weight"])


def test_consolidate_refuses_unknown_formats_and_incomplete_checkpoints(tmp_path: Path) -> None:
    """A bad fmt, and a checkpoint without .metadata, are errors that say so."""
    with pytest.raises(
        ValueError, match=r"^consolidate: fmt must be 'safetensors' or 'torch', got 'npz'$"
    ):
        consolidate(tmp_path / "ckpt", tmp_path / "out", fmt="npz")  # type: ignore[arg-type]
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(
        CheckpointError,
        match=rf"^{re.escape(str(tmp_path / 'ckpt'))} is not a complete checkpoint: it has no "
        r"\.metadata",
    ):
        consolidate(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()
