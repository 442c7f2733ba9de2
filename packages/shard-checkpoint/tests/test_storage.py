"""save and load in one process: atomic replacement, crash windows, and errors that name keys.

No process group here: DCP runs in one process and the state dicts hold
plain tensors. The multi-rank behaviour of the same code (resharding, a rank
failing mid-save) is covered in ``test_roundtrip.py`` and ``test_failures.py``.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

import shard_checkpoint._storage as storage
from shard_checkpoint import CheckpointError, load, resolve_checkpoint, save


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(4, generator=g)},
        "step": seed,
    }


def _blank() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(4)}, "step": -1}


def _assert_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["step"] == want["step"]
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), key


class FailingWriter(FileSystemWriter):
    """Raises while writing data, as a full disk would."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        raise OSError("disk full (simulated)")


def test_save_then_load_round_trips(tmp_path: Path) -> None:
    """Tensors come back bit-identically, other values as saved; nothing is left beside it."""
    save(_state(1), checkpoint_id=tmp_path / "ckpt")
    state = _blank()
    load(state, checkpoint_id=tmp_path / "ckpt")
    _assert_state(state, _state(1))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert (tmp_path / "ckpt" / ".metadata").is_file()


def test_save_replaces_a_checkpoint_and_cleans_up(tmp_path: Path) -> None:
    """A second save at the same path replaces the first and leaves no .old or staging dir."""
    save(_state(1), checkpoint_id=tmp_path / "ckpt")
    save(_state(2), checkpoint_id=tmp_path / "ckpt")
    state = _blank()
    load(state, checkpoint_id=tmp_path / "ckpt")
    _assert_state(state, _state(2))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_failed_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """A writer that fails leaves the old checkpoint in place and the new files marked."""
    path = tmp_path / "ckpt"
    save(_state(1), checkpoint_id=path)
    with pytest.raises(CheckpointError) as caught:
        save(_state(2), checkpoint_id=path, storage_writer=FailingWriter(path))
    assert re.fullmatch(
        rf"saving checkpoint {re.escape(str(path))} failed on rank 0: OSError: disk full "
        rf"\(simulated\); the previous checkpoint at {re.escape(str(path))} \(if any\) is "
        rf"untouched and loads as before; the files written are left in "
        rf"{re.escape(str(path))}\.incomplete-\w{{12}}; check the file system at that path "
        r"\(the error above\), or save elsewhere",
        str(caught.value),
    ), str(caught.value)
    state = _blank()
    load(state, checkpoint_id=path)
    _assert_state(state, _state(1))
    [staging] = [p for p in tmp_path.iterdir() if p != path]
    assert staging.name.startswith("ckpt.incomplete-")
    with pytest.raises(
        CheckpointError,
        match=rf"^{re.escape(str(staging))} is an incomplete checkpoint: a save that did not "
        rf"finish left it; load the last complete checkpoint, {re.escape(str(path))}$",
    ):
        load(_blank(), checkpoint_id=staging)


def test_save_interrupted_mid_swap_leaves_the_old_checkpoint_loadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Dying between the two renames leaves <path>.old, which load falls back to."""
    path = tmp_path / "ckpt"
    save(_state(1), checkpoint_id=path)
    calls: list[tuple[Any, Any]] = []
    real_replace = os.replace

    def replace_once(src: Any, dst: Any) -> None:
        calls.append((src, dst))
        if len(calls) == 2:
            raise OSError("killed (simulated)")
        real_replace(src, dst)

    monkeypatch.setattr(storage.os, "replace", replace_once)
    with pytest.raises(CheckpointError, match=r"moving them into place failed: killed"):
        save(_state(2), checkpoint_id=path)
    monkeypatch.undo()
    assert not path.exists()
    assert (tmp_path / "ckpt.old").is_dir()
    state = _blank()
    with caplog.at_level(logging.WARNING, logger="shard.checkpoint"):
        load(state, checkpoint_id=path)
    _assert_state(state, _state(1))
    assert f"{path} is missing but {path}.old is complete" in caplog.text
    assert resolve_checkpoint(path) == tmp_path / "ckpt.old"
    save(_state(3), checkpoint_id=path)  # the next save recovers fully
    assert sorted(p.name for p in tmp_path.iterdir() if "incomplete" not in p.name) == ["ckpt"]


def test_save_refuses_to_replace_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    """A file, or a directory with files but no .metadata, is never replaced; an empty dir is."""
    (tmp_path / "file").write_text("keep me")
    with pytest.raises(CheckpointError, match=r"it is a file; pass a directory path"):
        save(_state(1), checkpoint_id=tmp_path / "file")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "notes.txt").write_text("keep me")
    with pytest.raises(
        CheckpointError,
        match=r"the directory exists and is not a checkpoint \(it has files but no "
        r"\.metadata\), and saving would replace it",
    ):
        save(_state(1), checkpoint_id=tmp_path / "dir")
    assert (tmp_path / "dir" / "notes.txt").read_text() == "keep me"
    (tmp_path / "empty").mkdir()
    save(_state(1), checkpoint_id=tmp_path / "empty")
    assert (tmp_path / "empty" / ".metadata").is_file()


def test_load_explains_a_missing_or_unfinished_checkpoint(tmp_path: Path) -> None:
    """No path, a directory without .metadata, and a save that never finished each say so."""
    with pytest.raises(
        CheckpointError,
        match=rf"^no checkpoint at {re.escape(str(tmp_path))}/ckpt: the path "
        r"does not exist$",
    ):
        load(_blank(), checkpoint_id=tmp_path / "ckpt")
    (tmp_path / "ckpt.incomplete-0123456789ab").mkdir()
    with pytest.raises(
        CheckpointError,
        match=r"the path does not exist \(a save to it did not finish: "
        r"ckpt\.incomplete-0123456789ab\)$",
    ):
        load(_blank(), checkpoint_id=tmp_path / "ckpt")
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(
        CheckpointError,
        match=r"ckpt is not a complete checkpoint: it has no \.metadata, which a save writes "
        r"last \(a save to it did not finish: ckpt\.incomplete-0123456789ab\); load a "
        r"checkpoint written by save\(\)$",
    ):
        load(_blank(), checkpoint_id=tmp_path / "ckpt")


def test_load_names_the_first_missing_key(tmp_path: Path) -> None:
    """strict: the first key the checkpoint lacks is named; strict=False leaves it untouched."""
    save(_state(1), checkpoint_id=tmp_path / "ckpt")
    state = _blank()
    state["model"]["extra"] = torch.full((2,), 7.0)
    with pytest.raises(
        CheckpointError,
        match=rf"^checkpoint {re.escape(str(tmp_path))}/ckpt has no 'model\.extra' \(closest: "
        r"'model\.w'\); it holds 3 keys\. Load a checkpoint of this model, or pass "
        r"strict=False to load the keys it has$",
    ):
        load(state, checkpoint_id=tmp_path / "ckpt")
    load(state, checkpoint_id=tmp_path / "ckpt", strict=False)
    _assert_state(state, _state(1))
    assert torch.equal(state["model"]["extra"], torch.full((2,), 7.0))


def test_load_names_a_key_of_another_shape(tmp_path: Path) -> None:
    """A tensor whose saved shape differs is named with both shapes."""
    save(_state(1), checkpoint_id=tmp_path / "ckpt")
    state = _blank()
    state["model"]["w"] = torch.zeros(5, 3)
    with pytest.raises(
        CheckpointError,
        match=r"holds 'model\.w' with shape \(4, 3\), but the state dict expects \(5, 3\); load "
        r"a checkpoint of this model \(the shapes saved are the full, unsharded ones\)$",
    ):
        load(state, checkpoint_id=tmp_path / "ckpt")


def test_load_names_the_first_key_of_a_truncated_file_without_checksums(tmp_path: Path) -> None:
    """A data file of PyTorch's DCP (no checksums) cut short names the first key it held.

    (Checkpoints with checksums report it as corrupt: ``test_integrity.py``.)
    """
    with storage.quiet_single_process():
        dcp.save(_state(1), checkpoint_id=tmp_path / "ckpt", no_dist=True)
    [data] = (tmp_path / "ckpt").glob("*.distcp")
    data.write_bytes(data.read_bytes()[:10])
    with pytest.raises(
        CheckpointError,
        match=rf"is incomplete: the data of 'model\.w' is in {data.name}, which has only 10 "
        r"bytes \(needs \d+\); the checkpoint was damaged after it was written",
    ):
        load(_blank(), checkpoint_id=tmp_path / "ckpt")


def test_a_collective_timeout_during_save_is_a_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank that died makes DCP's collectives time out: reported as a failed save, old kept."""
    path = tmp_path / "ckpt"
    save(_state(1), checkpoint_id=path)

    def time_out(*args: Any, **kwargs: Any) -> None:
        raise torch.distributed.DistBackendError("gloo: timed out waiting for rank 1")

    monkeypatch.setattr(storage, "dcp_save", time_out)
    with pytest.raises(
        CheckpointError,
        match=rf"^saving checkpoint {re.escape(str(path))} failed: DistBackendError: gloo: timed "
        rf"out waiting for rank 1; the previous checkpoint at {re.escape(str(path))} \(if any\) "
        r"is untouched",
    ):
        save(_state(2), checkpoint_id=path)
    state = _blank()
    load(state, checkpoint_id=path)
    _assert_state(state, _state(1))
