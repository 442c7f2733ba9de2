"""Checksums: every file of a checkpoint is covered, and no damage to one loads silently.

The exhaustive cases (every single bit of every file flipped, every
truncation, every deletion) run the verification function on a tiny
checkpoint held in memory (``MemorySource``): the same code ``load`` and
``verify_checkpoint`` run on the files, without a process group or a disk
per case. A seeded sample of flips then goes through ``load`` itself, and
the multi-rank case through 2 ranks of the pool. PyTorch's DCP reads our
checkpoints and we read its (unverified, with a logged note), side by side.
"""

from __future__ import annotations

import logging
import pickle
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import shard_checkpoint._checksums as checksums
from shard_checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    StateDictOptions,
    consolidate,
    get_model_state_dict,
    load,
    save,
    verify_checkpoint,
)
from shard_checkpoint._checksums import CHECKSUMS_MARK, checksum, decode_manifest
from shard_checkpoint._integrity import MemorySource, verify
from shard_checkpoint._storage import quiet_single_process
from shard_runtime import fully_shard
from shard_testing import RankPool
from shard_testing.models import ToyNet

_TAIL = (
    "it changed after its save completed (a disk, copy or transfer error, or a file edited or "
    "removed by hand), so loading it would give wrong values; "
)
_NONE_BESIDE = (
    "no intact checkpoint is beside it: restore it from a copy, or train again from the start"
)


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(4, generator=g)},
        "step": seed,
    }


def _blank() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(4)}, "step": -1}


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _items(path: Path) -> dict[str, tuple[str, int, int]]:
    """Key -> (file, start, end) of each saved item, from the checkpoint's .metadata."""
    metadata = pickle.loads((path / ".metadata").read_bytes())
    return {
        index.fqn: (info.relative_path, info.offset, info.offset + info.length)
        for index, info in metadata.storage_data.items()
    }


@pytest.fixture
def tiny(tmp_path: Path) -> dict[str, bytes]:
    """The files of the smallest checkpoint worth damaging: one tensor of 4 floats."""
    save({"w": torch.arange(4.0)}, checkpoint_id=tmp_path / "tiny")
    return _files(tmp_path / "tiny")


def test_save_writes_the_checksums_of_every_file_segmented_by_item(tmp_path: Path) -> None:
    """.checksums covers .metadata and the data file whole, one segment per saved item."""
    path = tmp_path / "ckpt"
    save(_state(1), checkpoint_id=path)
    files = _files(path)
    assert sorted(files) == [".checksums", ".metadata", "__0_0.distcp"]
    manifest = decode_manifest(files[".checksums"])
    assert sorted(manifest.files) == [".metadata", "__0_0.distcp"]
    for name, entry in manifest.files.items():
        assert (entry.rank, entry.size) == (0, len(files[name]))
        for offset, length, crc in entry.segments:
            assert checksum(files[name][offset : offset + length]) == crc
    items = _items(path)
    assert sorted((start, end) for _, start, end in items.values()) == [
        (offset, offset + length) for offset, length, _ in manifest.files["__0_0.distcp"].segments
    ]
    assert [(offset, length) for offset, length, _ in manifest.files[".metadata"].segments] == [
        (0, len(files[".metadata"]))
    ]
    metadata = pickle.loads(files[".metadata"])
    assert metadata.storage_meta.modules == [CHECKSUMS_MARK]


def test_every_single_bit_flip_is_detected(tiny: dict[str, bytes]) -> None:
    """Flip each bit of each file in turn: the verification names the flipped file, every time."""
    flips = 0
    for name, data in tiny.items():
        for bit in range(len(data) * 8):
            damaged = bytearray(data)
            damaged[bit // 8] ^= 1 << (bit % 8)
            with pytest.raises(CorruptCheckpointError) as caught:
                verify("tiny", MemorySource({**tiny, name: bytes(damaged)}))
            assert caught.value.file == name
            flips += 1
    assert flips == 8 * sum(len(data) for data in tiny.values()) > 15_000


def test_every_truncation_extension_and_deletion_is_detected(tiny: dict[str, bytes]) -> None:
    """Each file cut to every shorter length, grown by a byte, or deleted: never verified."""
    for name, data in tiny.items():
        for size in [*range(len(data)), len(data) + 1]:
            changed = data[:size] if size < len(data) else data + b"\0"
            with pytest.raises(CheckpointError):
                verify("tiny", MemorySource({**tiny, name: changed}))
        remaining = {other: content for other, content in tiny.items() if other != name}
        with pytest.raises(CheckpointError):
            verify("tiny", MemorySource(remaining))


def test_damage_to_each_file_is_named_exactly(tiny: dict[str, bytes]) -> None:
    """The message names the file, the rank that wrote it, the bytes and the key in them."""
    data = tiny["__0_0.distcp"]
    damaged = data[:-1] + bytes([data[-1] ^ 0x80])
    with pytest.raises(CorruptCheckpointError) as caught:
        verify("tiny", MemorySource({**tiny, "__0_0.distcp": damaged}))
    assert str(caught.value) == (
        f"checkpoint tiny is corrupt: __0_0.distcp (written by rank 0) does not match its "
        f"checksum at bytes 0-{len(data)} (the data of 'w', chunk at offsets (0,)); {_TAIL}"
        "load an earlier checkpoint"
    )
    cases = {
        "__0_0.distcp": (
            data[:100],
            f"__0_0.distcp (written by rank 0) has 100 bytes where the save wrote {len(data)} "
            "(the data of 'w', chunk at offsets (0,))",
        ),
        ".metadata": (
            tiny[".metadata"][:-1] + b"\0",
            f".metadata (written by rank 0) does not match its checksum at bytes "
            f"0-{len(tiny['.metadata'])}",
        ),
        ".checksums": (
            tiny[".checksums"].replace(b'"size":', b'"size":1', 1),
            ".checksums (written by rank 0) is damaged (its own checksum does not match its "
            "contents)",
        ),
    }
    for name, (changed, culprit) in cases.items():
        with pytest.raises(CorruptCheckpointError) as caught:
            verify("tiny", MemorySource({**tiny, name: changed}))
        assert str(caught.value) == (
            f"checkpoint tiny is corrupt: {culprit}; {_TAIL}load an earlier checkpoint"
        )
    missing = {name: content for name, content in tiny.items() if name != ".checksums"}
    with pytest.raises(CorruptCheckpointError) as caught:
        verify("tiny", MemorySource(missing))
    assert str(caught.value).startswith(
        "checkpoint tiny is corrupt: .checksums (written by rank 0) is missing (its .metadata "
        "says the save wrote one); "
    )


def test_load_refuses_a_flipped_bit_and_names_the_newest_intact_checkpoint(
    tmp_path: Path,
) -> None:
    """load() raises before handing over values; the intact step beside it is named."""
    save(_state(3), checkpoint_id=tmp_path / "step-3")
    save(_state(6), checkpoint_id=tmp_path / "step-6")
    save(_state(9), checkpoint_id=tmp_path / "step-9")
    (tmp_path / "step-6" / ".checksums").unlink()  # damaged too: never offered as intact
    data_file = tmp_path / "step-9" / "__0_0.distcp"
    file, start, end = _items(tmp_path / "step-9")["model.w"]
    data = bytearray(data_file.read_bytes())
    data[end - 1] ^= 0x01  # the last byte of the tensor's values
    data_file.write_bytes(bytes(data))
    state = _blank()
    with pytest.raises(CorruptCheckpointError) as caught:
        load(state, checkpoint_id=tmp_path)  # the newest step: step-9
    assert str(caught.value) == (
        f"checkpoint {tmp_path}/step-9 is corrupt: {file} (written by rank 0) does not match its "
        f"checksum at bytes {start}-{end} (the data of 'model.w', chunk at offsets (0, 0)); "
        f"{_TAIL}the newest intact checkpoint beside it is {tmp_path}/step-3: load that one"
    )
    error = caught.value
    assert (error.file, error.rank, error.key, error.offsets) == (file, 0, "model.w", (0, 0))
    assert error.intact == str(tmp_path / "step-3")
    assert not torch.equal(state["model"]["w"], _state(9)["model"]["w"])  # never the bad bytes
    load(state, checkpoint_id=error.intact)
    assert torch.equal(state["model"]["w"], _state(3)["model"]["w"])


def test_a_seeded_sample_of_flips_never_loads(tmp_path: Path) -> None:
    """120 random bit positions over all files (seed 0), each through load() from disk."""
    path = tmp_path / "ckpt"
    save(_state(1), checkpoint_id=path)
    files = _files(path)
    positions = [(name, bit) for name, data in files.items() for bit in range(len(data) * 8)]
    for name, bit in random.Random(0).sample(positions, 120):
        damaged = bytearray(files[name])
        damaged[bit // 8] ^= 1 << (bit % 8)
        (path / name).write_bytes(bytes(damaged))
        with pytest.raises(CorruptCheckpointError) as caught:
            load(_blank(), checkpoint_id=path)
        assert caught.value.file == name
        (path / name).write_bytes(files[name])
    state = _blank()
    load(state, checkpoint_id=path)
    assert torch.equal(state["model"]["w"], _state(1)["model"]["w"])


def test_consolidate_refuses_a_flipped_bit(tmp_path: Path) -> None:
    """consolidate reads through the same checks: no file is written from damaged bytes."""
    path = tmp_path / "ckpt"
    save(_state(1), checkpoint_id=path)
    file, _, end = _items(path)["model.b"]
    data = bytearray((path / file).read_bytes())
    data[end - 1] ^= 0x02
    (path / file).write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError) as caught:
        consolidate(path, tmp_path / "model.safetensors", prefix="model.")
    assert (caught.value.file, caught.value.key) == (file, "model.b")
    assert caught.value.searched
    assert not (tmp_path / "model.safetensors").exists()


def test_verify_checkpoint_reports_what_it_read(tmp_path: Path) -> None:
    """Every file is read; a checkpoint of PyTorch's DCP is reported as not checksummed."""
    save(_state(1), checkpoint_id=tmp_path / "ours")
    report = verify_checkpoint(tmp_path / "ours")
    sizes = [(tmp_path / "ours" / name).stat().st_size for name in (".metadata", "__0_0.distcp")]
    assert (report.path, report.checksummed, report.files, report.bytes) == (
        tmp_path / "ours",
        True,
        2,
        sum(sizes),
    )
    with quiet_single_process():
        dcp.save(_state(1), checkpoint_id=tmp_path / "theirs", no_dist=True)
    report = verify_checkpoint(tmp_path / "theirs")
    assert (report.checksummed, report.files, report.bytes) == (False, 0, 0)


def test_a_checkpoint_of_pytorch_dcp_loads_unverified_with_a_note(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """PyTorch's DCP checkpoint (no checksums): our load gives what DCP's own load gives."""
    with quiet_single_process():
        dcp.save(_state(5), checkpoint_id=tmp_path / "theirs", no_dist=True)
    ours, theirs = _blank(), _blank()
    with caplog.at_level(logging.WARNING, logger="shard.checkpoint"):
        load(ours, checkpoint_id=tmp_path / "theirs")
    with quiet_single_process():
        dcp.load(theirs, checkpoint_id=tmp_path / "theirs", no_dist=True)
    assert ours["step"] == theirs["step"] == 5
    for key in ("w", "b"):
        assert torch.equal(ours["model"][key], theirs["model"][key])
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"shard.checkpoint: {tmp_path}/theirs has no checksums (written by PyTorch's "
        "torch.distributed.checkpoint, or before shard-checkpoint wrote them); loading it "
        "without verifying its bytes"
    ]


def test_pytorch_dcp_loads_a_checkpoint_with_checksums(tmp_path: Path) -> None:
    """DCP's own load ignores .checksums and the mark: the same values as ours."""
    save(_state(7), checkpoint_id=tmp_path / "ours")
    ours, theirs = _blank(), _blank()
    load(ours, checkpoint_id=tmp_path / "ours")
    with quiet_single_process():
        dcp.load(theirs, checkpoint_id=tmp_path / "ours", no_dist=True)
    assert ours["step"] == theirs["step"] == 7
    for key in ("w", "b"):
        assert torch.equal(ours["model"][key], theirs["model"][key])


class _FlippingDisk:
    """A file that keeps another bit than it was given wherever ``needle`` passes through."""

    def __init__(self, raw: Any, needle: bytes) -> None:
        self._raw = raw
        self._needle = needle

    def write(self, data: Any) -> int:
        given = bytes(data)
        at = given.find(self._needle)
        if at >= 0:
            kept = bytearray(given)
            kept[at + len(self._needle) - 1] ^= 0x01
            self._raw.write(bytes(kept))
            return len(given)
        return int(self._raw.write(given))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def test_save_with_verify_refuses_storage_that_changes_what_it_was_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that flips a bit on its way: verify=True fails the save, the old one stays."""
    path = tmp_path / "ckpt"
    save(_state(1), checkpoint_id=path)
    needle = _state(2)["model"]["w"].numpy().tobytes()  # the 12 float32 values of model.w
    real_init = checksums.ChecksummingFile.__init__

    def flipping_init(self: checksums.ChecksummingFile, file: Any, **kwargs: Any) -> None:
        real_init(self, _FlippingDisk(file, needle), **kwargs)

    monkeypatch.setattr(checksums.ChecksummingFile, "__init__", flipping_init)
    with pytest.raises(CheckpointError) as caught:
        save(_state(2), checkpoint_id=path, verify=True)
    [staging] = tmp_path.glob("ckpt.incomplete-*")
    file, start, end = _items(staging)["model.w"]
    assert str(caught.value) == (
        f"saving checkpoint {path} failed: {file} (written by rank 0) does not match its "
        f"checksum at bytes {start}-{end} (the data of 'model.w', chunk at offsets (0, 0)) when "
        "read back right after it was written, so the storage did not keep the bytes it was "
        f"given; the previous checkpoint at {path} (if any) is untouched and loads as before; "
        f"the files written are left in {staging}"
    )
    state = _blank()
    load(state, checkpoint_id=path)
    assert state["step"] == 1
    save(_state(2), checkpoint_id=path)  # without verify the save completes ...
    with pytest.raises(CorruptCheckpointError, match=r"at bytes \d+-\d+ \(the data of 'model.w'"):
        load(_blank(), checkpoint_id=path)  # ... and the load refuses it


def _save_sharded(path: str) -> None:
    torch.manual_seed(0)
    model = ToyNet()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    save({"model": get_model_state_dict(model)}, checkpoint_id=path)


def _load_sharded_error(path: str) -> dict[str, Any]:
    model = ToyNet()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    state = {"model": get_model_state_dict(model)}
    try:
        load(state, checkpoint_id=path)
    except CorruptCheckpointError as exc:
        return {"message": str(exc), "rank": exc.rank, "key": exc.key, "type": type(exc).__name__}
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {"rank": dist.get_rank(), "loaded": {k: v.sum().item() for k, v in full.items()}}


def test_a_flip_in_one_ranks_file_fails_the_load_on_every_rank(
    rank_pool: RankPool, tmp_path: Path
) -> None:
    """2 ranks save; a bit of rank 1's file flips; both ranks raise the same error naming it."""
    rank_pool.run(_save_sharded, 2, str(tmp_path / "step-1"))
    rank_pool.run(_save_sharded, 2, str(tmp_path / "step-2"))
    items = pickle.loads((tmp_path / "step-2" / ".metadata").read_bytes()).storage_data
    [(index, info)] = [
        (index, info)
        for index, info in items.items()
        if index.fqn == "model.blocks.1.inner.weight" and info.relative_path == "__1_0.distcp"
    ]
    data_file = tmp_path / "step-2" / "__1_0.distcp"
    data = bytearray(data_file.read_bytes())
    data[info.offset + info.length - 3] ^= 0x10
    data_file.write_bytes(bytes(data))
    results = rank_pool.run(_load_sharded_error, 2, str(tmp_path / "step-2"))
    start, end = info.offset, info.offset + info.length
    expected = (
        f"checkpoint {tmp_path}/step-2 is corrupt: __1_0.distcp (written by rank 1) does not "
        f"match its checksum at bytes {start}-{end} (the data of 'model.blocks.1.inner.weight', "
        f"chunk at offsets {tuple(index.offset)}); {_TAIL}the newest intact checkpoint beside "
        f"it is {tmp_path}/step-1: load that one"
    )
    assert (
        results
        == [
            {
                "message": expected,
                "rank": 1,
                "key": "model.blocks.1.inner.weight",
                "type": "CorruptCheckpointError",
            }
        ]
        * 2
    )
    assert re.fullmatch(r"\(\d+, 0\)", str(tuple(index.offset)))
