"""The streaming safetensors writer: format, alignment, and what other readers see."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from shard_checkpoint import CheckpointError
from shard_checkpoint._safetensors import read_safetensors, write_safetensors


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "half": torch.randn(3, 5, generator=g).half(),
        "bf16": torch.randn(7, generator=g).bfloat16(),
        "f32": torch.randn(2, 3, 4, generator=g),
        "f64": torch.randn(5, generator=g, dtype=torch.float64),
        "i8": torch.arange(-3, 4, dtype=torch.int8),
        "i64": torch.arange(6).reshape(2, 3),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> list[str]:
    produced: list[str] = []

    def produce(name: str) -> torch.Tensor:
        produced.append(name)
        return tensors[name]

    specs = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    write_safetensors(path, specs, produce, metadata={"format": "pt"})
    return produced


def test_round_trip_through_our_reader(tmp_path: Path) -> None:
    """Every supported dtype and shape (0-d, empty) reads back bit-identically."""
    tensors = _tensors()
    _write(tmp_path / "t.safetensors", tensors)
    loaded, metadata = read_safetensors(tmp_path / "t.safetensors")
    assert metadata == {"format": "pt"}
    assert sorted(loaded) == sorted(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype
        assert torch.equal(loaded[name], tensor), name


def test_layout_is_aligned_and_streamed_widest_first(tmp_path: Path) -> None:
    """The header is 8-byte padded; tensors are produced widest dtype first, each aligned."""
    tensors = _tensors()
    produced = _write(tmp_path / "t.safetensors", tensors)
    assert produced == ["f64", "i64", "f32", "scalar", "empty", "half", "bf16", "i8", "flag"]
    raw = (tmp_path / "t.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    assert length % 8 == 0
    header = json.loads(raw[8 : 8 + length])
    end = 0
    for name in produced:
        begin, stop = header[name]["data_offsets"]
        assert begin == end
        assert begin % tensors[name].element_size() == 0
        end = stop
    assert 8 + length + end == len(raw)


def test_safetensors_package_reads_our_files(tmp_path: Path) -> None:
    """Files we write load with the safetensors package itself, where it is installed."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    tensors = _tensors()
    _write(tmp_path / "t.safetensors", tensors)
    loaded = safetensors_torch.load_file(tmp_path / "t.safetensors")
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor), name


def _never(name: str) -> torch.Tensor:
    raise AssertionError(f"{name} was produced")


def test_unsupported_dtype_names_the_tensor(tmp_path: Path) -> None:
    """A dtype safetensors cannot store is refused before anything is produced."""
    with pytest.raises(
        CheckpointError,
        match=r"^'z' has dtype torch\.complex64, which safetensors cannot store; write it with "
        r"fmt='torch'$",
    ):
        write_safetensors(tmp_path / "t.safetensors", [("z", (2,), torch.complex64)], _never)
    assert not (tmp_path / "t.safetensors").exists()


def test_produced_tensor_must_match_its_header(tmp_path: Path) -> None:
    """A tensor that does not match the header it was announced with is an error."""
    with pytest.raises(
        CheckpointError,
        match=r"^'w': expected a torch\.float32 tensor of shape \(2, 2\), got torch\.float32 "
        r"of shape \(4,\)$",
    ):
        write_safetensors(
            tmp_path / "t.safetensors", [("w", (2, 2), torch.float32)], lambda _: torch.ones(4)
        )
