"""A directory of step-<N> checkpoints: the newest is read, the newest intact found, older pruned.

One process, plain tensors: what is tested is which directory is chosen or
removed, from the names and contents on disk.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shard_checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load,
    newest_intact_checkpoint,
    prune_checkpoints,
    resolve_checkpoint,
    save,
    step_checkpoint_id,
)
from shard_checkpoint._storage import quiet_single_process


def _save(root: Path, step: int) -> Path:
    path = step_checkpoint_id(root, step)
    save({"w": torch.full((3,), float(step)), "step": step}, checkpoint_id=path, verify=True)
    return path


def _leftovers(root: Path) -> None:
    """What crashed saves, an interrupted swap and an interrupted prune leave behind."""
    for name in ("step-2.incomplete-0123456789ab", "step-9.incomplete-ba9876543210", "step-1.old"):
        (root / name).mkdir()
        (root / name / "__0_0.distcp").write_bytes(b"partial")
    (root / "step-3.removing-00ff00ff00ff").mkdir()


def test_the_newest_complete_step_is_read(tmp_path: Path) -> None:
    """Steps sort by number (10 after 9); incomplete, .old and other names are not steps."""
    for step in (2, 9, 10):
        _save(tmp_path, step)
    _leftovers(tmp_path)
    (tmp_path / "step-11").mkdir()  # not a checkpoint: no .metadata
    (tmp_path / "notes").mkdir()
    assert step_checkpoint_id(tmp_path, 10) == tmp_path / "step-10"
    assert latest_checkpoint(tmp_path) == tmp_path / "step-10"
    assert resolve_checkpoint(tmp_path) == tmp_path / "step-10"
    state = {"w": torch.zeros(3), "step": -1}
    load(state, checkpoint_id=tmp_path)
    assert state["step"] == 10
    assert latest_checkpoint(tmp_path / "notes") is None
    with pytest.raises(CheckpointError, match=r"it has no \.metadata, which a save writes last"):
        resolve_checkpoint(tmp_path / "notes")
    (tmp_path / "notes" / "step-4.incomplete-0123456789ab").mkdir()
    with pytest.raises(CheckpointError) as caught:
        resolve_checkpoint(tmp_path / "notes")
    assert str(caught.value) == (
        f"{tmp_path}/notes is not a complete checkpoint: it has no .metadata, which a save writes "
        "last (it holds only unfinished step saves: step-4.incomplete-0123456789ab); load a "
        "checkpoint written by save()"
    )


def test_keep_last_keeps_the_newest_k_and_removes_leftovers(tmp_path: Path) -> None:
    """keep_last=2 after step 5: steps 4 and 5 stay; older steps and every leftover go."""
    for step in range(1, 5):
        _save(tmp_path, step)
    _leftovers(tmp_path)
    newest = _save(tmp_path, 5)
    removed = prune_checkpoints(tmp_path, newest=newest, keep_last=2)
    assert [p.name for p in removed] == [
        "step-1",
        "step-2",
        "step-3",
        "step-1.old",
        "step-2.incomplete-0123456789ab",
        "step-3.removing-00ff00ff00ff",
        "step-9.incomplete-ba9876543210",
    ]
    assert sorted(os.listdir(tmp_path)) == ["step-4", "step-5"]


def test_keep_last_one_keeps_only_the_checkpoint_just_saved(tmp_path: Path) -> None:
    """keep_last=1: the newest (intact) checkpoint is the one left."""
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    assert [p.name for p in prune_checkpoints(tmp_path, newest=newest, keep_last=1)] == ["step-1"]
    assert os.listdir(tmp_path) == ["step-2"]


def test_steps_above_the_new_one_belong_to_another_run_and_go(tmp_path: Path) -> None:
    """A run that restarted from step 3 in a directory holding steps up to 9: 9 is removed."""
    for step in (3, 6, 9):
        _save(tmp_path, step)
    newest = _save(tmp_path, 4)
    removed = prune_checkpoints(tmp_path, newest=newest, keep_last=None)
    assert [p.name for p in removed] == ["step-6", "step-9"]
    assert sorted(os.listdir(tmp_path)) == ["step-3", "step-4"]
    assert latest_checkpoint(tmp_path) == newest


def test_prune_refuses_what_is_not_the_new_step(tmp_path: Path) -> None:
    """keep_last below 1, or a newest that is not a complete step under root: nothing removed."""
    newest = _save(tmp_path, 1)
    with pytest.raises(
        ValueError, match=r"^keep_last must be at least 1 \(the newest checkpoint\)"
    ):
        prune_checkpoints(tmp_path, newest=newest, keep_last=0)
    save({"w": torch.zeros(3)}, checkpoint_id=tmp_path / "other")
    with pytest.raises(ValueError, match=r"other is not a complete step-<N> checkpoint directory"):
        prune_checkpoints(tmp_path, newest=tmp_path / "other", keep_last=1)
    assert sorted(os.listdir(tmp_path)) == ["other", "step-1"]


def test_newest_intact_skips_damaged_and_unverifiable_checkpoints(tmp_path: Path) -> None:
    """Newest first: a flipped bit (step 9) and no checksums (step 6, PyTorch's DCP) are passed."""
    _save(tmp_path, 3)
    with quiet_single_process():
        dcp.save({"w": torch.zeros(3)}, checkpoint_id=tmp_path / "step-6", no_dist=True)
    damaged = _save(tmp_path, 9) / "__0_0.distcp"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 1
    damaged.write_bytes(bytes(data))
    assert newest_intact_checkpoint(tmp_path) == tmp_path / "step-3"
    assert newest_intact_checkpoint(tmp_path, besides=tmp_path / "step-3") is None
