"""A save that fails midway keeps the previous checkpoint; bad checkpoints fail loudly.

The failing save uses a ``FileSystemWriter`` that raises on one rank, either
while writing its data (rank 1) or while writing the metadata (rank 0, the
last step of a save). Every rank must see the error, the previous checkpoint
must still load with its own values, and the new files must sit in a
directory whose name says they are incomplete. Loading a checkpoint that
does not fit the model, or that lost a data file, names the first key that
cannot load, on every rank.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.device_mesh import init_device_mesh
from torch.futures import Future

from shard_checkpoint import (
    CheckpointError,
    StateDictOptions,
    get_model_state_dict,
    load,
    save,
    set_model_state_dict,
)
from shard_runtime import fully_shard
from shard_testing import RankPool
from shard_testing.models import HIDDEN, ToyNet

FULL = StateDictOptions(full_state_dict=True)


class FailingWriter(FileSystemWriter):
    """Raises ``OSError`` on ``rank`` in ``step`` (``"write_data"`` or ``"finish"``)."""

    def __init__(self, path: str, *, rank: int, step: str) -> None:
        super().__init__(path)
        self._fail_rank = rank
        self._fail_step = step

    def _maybe_fail(self, step: str) -> None:
        if step == self._fail_step and dist.get_rank() == self._fail_rank:
            raise OSError(f"disk full (simulated in {step})")

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self._maybe_fail("write_data")
        return super().write_data(plan, planner)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self._maybe_fail("finish")
        super().finish(metadata, results)


def _model(*, blocks: int = 3, head_rows: int = 3, zeroed: bool = False) -> ToyNet:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = ToyNet(blocks)
    model.head = nn.Linear(HIDDEN, head_rows)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if zeroed:
        with torch.no_grad():
            for param in model.parameters():
                param.zero_()
    return model


def _load_into_fresh(path: str, **kwargs: Any) -> dict[str, torch.Tensor]:
    model = _model(zeroed=True, **kwargs)
    state = {"model": get_model_state_dict(model)}
    load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    return get_model_state_dict(model, options=FULL)


def _failed_save(path: str, fail_rank: int, fail_step: str) -> dict[str, Any]:
    model = _model()
    save({"model": get_model_state_dict(model)}, checkpoint_id=path)
    previous = get_model_state_dict(model, options=FULL)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    writer = FailingWriter(path, rank=fail_rank, step=fail_step)
    with pytest.raises(CheckpointError) as caught:
        save({"model": get_model_state_dict(model)}, checkpoint_id=path, storage_writer=writer)
    dist.barrier()
    with pytest.raises(CheckpointError) as incomplete:
        _load_into_fresh(next(str(p) for p in Path(path).parent.glob("*.incomplete-*")))
    return {
        "error": str(caught.value),
        "previous": previous,
        "loaded": _load_into_fresh(path),
        "listing": sorted(os.listdir(Path(path).parent)),
        "incomplete_error": str(incomplete.value),
    }


def _load_error(path: str, blocks: int, head_rows: int) -> str:
    with pytest.raises(CheckpointError) as caught:
        _load_into_fresh(path, blocks=blocks, head_rows=head_rows)
    return str(caught.value)


def _save(path: str) -> None:
    save({"model": get_model_state_dict(_model())}, checkpoint_id=path)


@pytest.mark.parametrize(
    ("fail_rank", "fail_step"), [(1, "write_data"), (0, "finish")], ids=["data", "metadata"]
)
def test_failed_save_leaves_the_previous_checkpoint_loadable(
    rank_pool: RankPool, tmp_path: Path, fail_rank: int, fail_step: str
) -> None:
    """Every rank raises; the old checkpoint loads its old values; the new one is marked."""
    path = tmp_path / "ckpt"
    results = rank_pool.run(_failed_save, 2, str(path), fail_rank, fail_step)
    for result in results:
        assert re.fullmatch(
            rf"saving checkpoint {re.escape(str(path))} failed on rank {fail_rank}: "
            rf"OSError: disk full \(simulated in {fail_step}\); the previous checkpoint at "
            rf"{re.escape(str(path))} \(if any\) is untouched and loads as before; the files "
            rf"written are left in {re.escape(str(path))}\.incomplete-[0-9a-f]{{12}}; check the "
            r"file system at that path \(the error above\), or save elsewhere",
            result["error"],
        ), result["error"]
        assert [re.sub("[0-9a-f]{12}$", "*", n) for n in result["listing"]] == [
            "ckpt",
            "ckpt.incomplete-*",
        ]
        assert list(result["loaded"]) == list(result["previous"])
        for key, value in result["previous"].items():
            assert torch.equal(result["loaded"][key], value), key
        assert re.fullmatch(
            rf".*\.incomplete-[0-9a-f]{{12}} is an incomplete checkpoint: a save that did not "
            rf"finish left it; load the last complete checkpoint, {re.escape(str(path))}",
            result["incomplete_error"],
        )


def test_loading_a_checkpoint_of_another_model_names_the_first_key(
    rank_pool: RankPool, tmp_path: Path
) -> None:
    """A missing key and a different shape are reported, by name, on every rank."""
    path = str(tmp_path / "ckpt")
    rank_pool.run(_save, 2, path)
    missing = rank_pool.run(_load_error, 2, path, 4, 3)
    assert (
        missing
        == [
            f"checkpoint {path} has no 'model.blocks.3.inner.weight' (closest: "
            "'model.blocks.2.inner.weight'); it holds 16 keys. Load a checkpoint of this model, "
            "or pass strict=False to load the keys it has"
        ]
        * 2
    )
    shape = rank_pool.run(_load_error, 2, path, 3, 5)
    assert (
        shape
        == [
            f"checkpoint {path} holds 'model.head.weight' with shape (3, 10), but the state dict "
            "expects (5, 10); load a checkpoint of this model (the shapes saved are the full, "
            "unsharded ones)"
        ]
        * 2
    )


def test_loading_a_checkpoint_that_lost_a_data_file_names_the_first_key(
    rank_pool: RankPool, tmp_path: Path
) -> None:
    """A deleted rank file makes loading fail on every rank, naming the rank and its first key."""
    path = tmp_path / "ckpt"
    rank_pool.run(_save, 2, str(path))
    (path / "__1_0.distcp").unlink()
    errors = rank_pool.run(_load_error, 2, str(path), 3, 3)
    assert (
        errors
        == [
            f"checkpoint {path} is corrupt: __1_0.distcp (written by rank 1) is missing (the "
            "data of 'model.embed.weight', chunk at offsets (5, 0)); it changed after its save "
            "completed (a disk, copy or transfer error, or a file edited or removed by hand), so "
            "loading it would give wrong values; no intact checkpoint is beside it: restore it "
            "from a copy, or train again from the start"
        ]
        * 2
    )
