"""The streaming torch.save writer: torch.load and zip tools read its files."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from shard_checkpoint import CheckpointError
from shard_checkpoint._torch_file import TensorPlaceholder, write_torch_file


def _values() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(4, 3, generator=g),
        "lr": 0.5,
        "b": torch.randn(5, generator=g).bfloat16(),
        "ids": torch.arange(6).reshape(2, 3),
        "names": ["w", "b"],
        "empty": torch.zeros(0, 2),
        "step": torch.tensor(3.0),
    }


def _write(path: Path, values: dict[str, Any]) -> list[str]:
    produced: list[str] = []

    def produce(name: str) -> torch.Tensor:
        produced.append(name)
        return values[name]

    layout = {
        k: TensorPlaceholder(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v
        for k, v in values.items()
    }
    write_torch_file(path, layout, produce)
    return produced


def _assert_same(loaded: dict[str, Any], values: dict[str, Any]) -> None:
    assert list(loaded) == list(values)
    for key, value in values.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype
            assert torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value


@pytest.mark.parametrize("mmap", [False, True])
def test_torch_load_reads_the_file(tmp_path: Path, mmap: bool) -> None:
    """Tensors (0-d, empty, bf16, int) and plain values load back with weights_only, mmap or not."""
    values = _values()
    produced = _write(tmp_path / "t.pt", values)
    assert produced == ["w", "b", "ids", "empty", "step"]
    _assert_same(torch.load(tmp_path / "t.pt", weights_only=True, mmap=mmap), values)


def test_zip_checksums_are_filled_in(tmp_path: Path) -> None:
    """Every zip entry's CRC-32 matches its data, so zip tools find the file sound."""
    _write(tmp_path / "t.pt", _values())
    with zipfile.ZipFile(tmp_path / "t.pt") as archive:
        assert archive.testzip() is None


def test_produced_tensor_must_match_its_placeholder(tmp_path: Path) -> None:
    """A tensor that does not match its placeholder is an error naming it."""
    with pytest.raises(
        CheckpointError,
        match=r"^'w': expected a torch\.float32 tensor of shape \(2, 2\), got torch\.float64 "
        r"of shape \(2, 2\)$",
    ):
        write_torch_file(
            tmp_path / "t.pt",
            {"w": TensorPlaceholder((2, 2), torch.float32)},
            lambda _: torch.ones(2, 2, dtype=torch.float64),
        )
