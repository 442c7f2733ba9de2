"""``shard ckpt``: what inspect reports and verifies, and consolidate's file (one process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shard_checkpoint import save
from shard_checkpoint._storage import quiet_single_process
from shard_cli import inspect_checkpoint
from shard_cli.__main__ import main
from shard_cli._format import format_bytes


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


def test_inspect_verify_reads_every_file(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--verify checks each file against its checksums and says how much it read."""
    sizes = sum((checkpoint / name).stat().st_size for name in (".metadata", "__0_0.distcp"))
    assert main(["ckpt", "inspect", "--verify", str(checkpoint)]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == (
        f"verified: every byte of its 2 files ({format_bytes(sizes)}) matches the checksums its "
        "save wrote"
    )
    assert main(["ckpt", "inspect", "--verify", "--json", str(checkpoint)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verified"] == {"checksummed": True, "files": 2, "bytes": sizes}


def test_inspect_verify_names_a_flipped_bit_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A corrupt newest step: status 1, and the message names the file, key and intact step."""
    for step in (3, 6):
        save(
            {"model": {"w": torch.full((4, 3), float(step))}},
            checkpoint_id=tmp_path / f"step-{step}",
        )
    data = tmp_path / "step-6" / "__0_0.distcp"
    damaged = bytearray(data.read_bytes())
    damaged[-1] ^= 0x04
    data.write_bytes(bytes(damaged))
    assert main(["ckpt", "inspect", str(tmp_path)]) == 0  # the structure is intact
    out = capsys.readouterr().out
    assert out.startswith(f"{tmp_path}: step checkpoints 3, 6; the newest:\n{tmp_path}/step-6: ")
    assert main(["ckpt", "inspect", "--verify", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"shard ckpt inspect: checkpoint {tmp_path}/step-6 is corrupt: __0_0.distcp (written by "
        f"rank 0) does not match its checksum at bytes 0-{data.stat().st_size} (the data of "
        "'model.w', chunk at offsets (0, 0)); it changed after its save completed (a disk, copy "
        "or transfer error, or a file edited or removed by hand), so loading it would give wrong "
        f"values; the newest intact checkpoint beside it is {tmp_path}/step-3: load that one\n"
    )


def test_inspect_verify_of_a_pytorch_checkpoint_says_it_has_no_checksums(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint of PyTorch's DCP: inspected as before, with a line that nothing was verified."""
    with quiet_single_process():
        dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "theirs", no_dist=True)
    assert main(["ckpt", "inspect", "--verify", str(tmp_path / "theirs")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"not verified: {tmp_path}/theirs has no checksums (written by PyTorch's "
        "torch.distributed.checkpoint, or before shard-checkpoint wrote them)"
    )
