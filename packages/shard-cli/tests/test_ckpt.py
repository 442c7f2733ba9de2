"""``shard ckpt``: what inspect reports, and consolidate's file, for a one-process checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shard_checkpoint import save
from shard_cli import inspect_checkpoint
from shard_cli.__main__ import main


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    state = {
        "model": {"w": torch.arange(12.0).reshape(4, 3), "b": torch.ones(3, dtype=torch.bfloat16)},
        "train": {"step": 7},
    }
    save(state, checkpoint_id=path)
    return path


def test_inspect_lists_keys_shapes_dtypes_sizes_and_writers(checkpoint: Path) -> None:
    """Every key with its full shape and dtype; one writing rank; bytes of the tensors."""
    info = inspect_checkpoint(checkpoint)
    entries = {e.key: (e.shape, e.dtype, e.nbytes, e.chunks) for e in info.entries}
    assert entries == {
        "model.w": ((4, 3), "float32", 48, 1),
        "model.b": ((3,), "bfloat16", 6, 1),
        "train.step": (None, "object", 0, 1),
    }
    assert (info.world_size, info.tensor_bytes) == (1, 54)
    assert info.file_bytes > 54


def test_inspect_command_prints_a_table(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The header line sums it up; one line per key follows."""
    assert main(["ckpt", "inspect", str(checkpoint)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{checkpoint}: 3 keys, written by 1 rank, tensors 54 B (54 bytes)")
    assert lines[2].split() == ["model.w", "4x3", "float32", "48", "1"]


def test_inspect_of_a_missing_checkpoint_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A path with no checkpoint exits with status 2 and says so."""
    assert main(["ckpt", "inspect", str(tmp_path / "nothing")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err


def test_consolidate_writes_the_model_by_default(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default prefix keeps the model's keys, without 'model.', in a torch file."""
    out = tmp_path / "model.pt"
    assert main(["ckpt", "consolidate", str(checkpoint), str(out), "--format", "torch"]) == 0
    assert "keys under 'model.'" in capsys.readouterr().out
    loaded = torch.load(out)
    assert sorted(loaded) == ["b", "w"]
    assert torch.equal(loaded["w"], torch.arange(12.0).reshape(4, 3))
