"""``shard train``'s checkpoints: --async-checkpoint, --keep-last, --resume latest-intact.

The flags resolve as documented; :class:`TrainCheckpointer` writes the same
checkpoints blocking and in the background, for both front ends on 2 ranks
of the pool, and removes only what a complete, verified save supersedes;
``load_training`` refuses a corrupt checkpoint or, asked to, falls back to
the newest intact one (one process: the choice does not depend on ranks).
``test_train_checkpoint_end_to_end.py`` runs the same through ``shard train``.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from shard_checkpoint import (
    CorruptCheckpointError,
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from shard_cli import TrainOptions, resolve_options
from shard_cli.__main__ import build_parser
from shard_cli._train_checkpoint import TrainCheckpointer, load_training, read_info
from shard_runtime import FullyShardedDataParallel, ModuleWrapPolicy, fully_shard
from shard_testing import RankPool
from shard_testing.models import ResidualBlock, ToyNet, toy_batches
from shard_testing.resume import assert_bitwise_equal

FULL = StateDictOptions(full_state_dict=True)


def _given(*argv: str) -> dict[str, Any]:
    namespace = build_parser().parse_args(["train", *argv])
    return {k: v for k, v in vars(namespace).items() if k not in ("command", "run")}


# ------------------------------------------------------------------ flags


def test_the_flags_resolve_to_options() -> None:
    """--resume [latest|latest-intact], --async-checkpoint and --keep-last K; off by default."""
    assert (TrainOptions().resume, TrainOptions().async_checkpoint, TrainOptions().keep_last) == (
        False,
        False,
        None,
    )
    assert _given("--resume") == {"resume": True}
    assert _given("--resume", "latest") == {"resume": "latest"}
    assert _given("--resume", "latest-intact") == {"resume": "latest-intact"}
    assert _given("--async-checkpoint", "--keep-last", "3") == {
        "async_checkpoint": True,
        "keep_last": 3,
    }
    options = resolve_options(_given("--async-checkpoint", "--keep-last", "3"))
    assert (options.async_checkpoint, options.keep_last) == (True, 3)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--resume", "newest"])


def test_keep_last_below_one_is_refused() -> None:
    """--keep-last 0 would remove the checkpoint just saved: an error naming the flag."""
    with pytest.raises(
        ValueError,
        match=r"^--keep-last must be at least 1 \(the newest checkpoint\), got 0; leave it out "
        r"to keep every checkpoint$",
    ):
        resolve_options({"keep_last": 0})


def test_a_resume_may_change_how_checkpoints_are_written(tmp_path: Path) -> None:
    """--resume latest-intact keeps its name; --async-checkpoint and --keep-last may change."""
    stored = TrainOptions(preset="tiny", run_dir=str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(stored.to_json()))
    for which, expected in (("latest", True), ("latest-intact", "latest-intact")):
        options = resolve_options(
            _given(
                "--resume",
                which,
                "--run-dir",
                str(tmp_path),
                "--async-checkpoint",
                "--keep-last",
                "2",
            )
        )
        assert (options.resume, options.async_checkpoint, options.keep_last) == (expected, True, 2)
    assert TrainOptions.from_json(options.to_json()) == options


# ------------------------------------------------------------------ 2 ranks, both front ends


def _build(front: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model: nn.Module = ToyNet(blocks=2, seed=0)
    if front == "fully_shard":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({ResidualBlock}))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    x, y = toy_batches(dist.get_world_size(), steps=step + 1)[step][0][dist.get_rank()]
    nn.functional.mse_loss(model(x), y).backward()
    optim.step()
    optim.zero_grad()


def _full(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy(
        {
            "model": get_model_state_dict(model, options=FULL),
            "optim": get_optimizer_state_dict(model, optim, options=FULL),
        }
    )


def _train_and_save(front: str, root: str, asynchronous: bool) -> dict[str, Any]:
    """4 steps, a save after each (keep the last 2); then a fresh model resumes from root."""
    model, optim = _build(front)
    saver = TrainCheckpointer(root, asynchronous=asynchronous, keep_last=2)
    for step in range(1, 5):
        _train_step(model, optim, step - 1)
        saver.save(model=model, optim=optim, frontend=front, step=step, world_size=2)
    saver.finish()
    trained = _full(model, optim)
    fresh, fresh_optim = _build(front)
    _train_step(fresh, fresh_optim, 0)
    step = load_training(root, model=fresh, optim=fresh_optim, frontend=front, mesh=None)
    return {
        "step": step,
        "trained": trained,
        "resumed": _full(fresh, fresh_optim),
        "listing": sorted(os.listdir(root)),
    }


@pytest.mark.parametrize("front", ["fully_shard", "wrapper"])
def test_async_and_blocking_saves_resume_to_the_same_state(
    rank_pool: RankPool, tmp_path: Path, front: str
) -> None:
    """Model and AdamW state resume bit for bit from both; --keep-last 2 leaves steps 3 and 4."""
    blocking = rank_pool.run(_train_and_save, 2, front, str(tmp_path / "blocking"), False)
    background = rank_pool.run(_train_and_save, 2, front, str(tmp_path / "async"), True)
    for result in (*blocking, *background):
        assert result["step"] == 4
        assert result["listing"] == ["step-3", "step-4"]
        assert_bitwise_equal(result["resumed"], result["trained"])
    for ours, theirs in zip(blocking, background, strict=True):
        assert_bitwise_equal(ours["trained"], theirs["trained"])


# ------------------------------------------------------------------ one process


def _plain_save(root: Path, saver: TrainCheckpointer, step: int) -> None:
    torch.manual_seed(step)
    model = nn.Linear(3, 2)
    saver.save(
        model=model,
        optim=torch.optim.SGD(model.parameters(), lr=0.1),
        frontend="fully_shard",
        step=step,
        world_size=1,
    )


def test_a_new_run_replaces_an_earlier_runs_steps_once_its_first_is_saved(tmp_path: Path) -> None:
    """Not resumed: the first save removes every other step (as the single checkpoint of earlier
    versions was replaced); a resumed run's first save removes only the steps above its own."""
    earlier = TrainCheckpointer(tmp_path)
    for step in (2, 4, 6):
        _plain_save(tmp_path, earlier, step)
    assert sorted(os.listdir(tmp_path)) == ["step-2", "step-4", "step-6"]
    resumed = TrainCheckpointer(tmp_path, resumed=True)
    _plain_save(tmp_path, resumed, 3)
    assert sorted(os.listdir(tmp_path)) == ["step-2", "step-3"]
    _plain_save(tmp_path, resumed, 5)  # later saves without --keep-last remove nothing
    assert sorted(os.listdir(tmp_path)) == ["step-2", "step-3", "step-5"]
    fresh = TrainCheckpointer(tmp_path, asynchronous=True)
    _plain_save(tmp_path, fresh, 1)
    fresh.finish()
    assert os.listdir(tmp_path) == ["step-1"]
    info = read_info(tmp_path)
    assert info is not None
    assert info.step == 1


def _corrupt_newest(tmp_path: Path) -> tuple[nn.Module, torch.optim.Optimizer, Path]:
    saver = TrainCheckpointer(tmp_path)
    for step in (3, 6):
        _plain_save(tmp_path, saver, step)
    data = tmp_path / "step-6" / "__0_0.distcp"
    damaged = bytearray(data.read_bytes())
    damaged[-100] ^= 0x01
    data.write_bytes(bytes(damaged))
    model = nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), data


def test_resume_refuses_a_corrupt_checkpoint_and_says_how_to_fall_back(tmp_path: Path) -> None:
    """Plain --resume: the error names the damage and the flag that resumes from step 3."""
    model, optim, _ = _corrupt_newest(tmp_path)
    with pytest.raises(CorruptCheckpointError) as caught:
        load_training(tmp_path, model=model, optim=optim, frontend="fully_shard", mesh=None)
    assert str(caught.value).startswith(f"checkpoint {tmp_path}/step-6 is corrupt: __0_0.distcp")
    assert str(caught.value).endswith(
        f"so loading it would give wrong values; the newest intact checkpoint beside it is "
        f"{tmp_path}/step-3: resume from it with --resume latest-intact"
    )


def test_resume_latest_intact_falls_back_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--resume latest-intact: step 3's values and step, and one line on stderr naming both."""
    model, optim, data = _corrupt_newest(tmp_path)
    step = load_training(
        tmp_path, model=model, optim=optim, frontend="fully_shard", mesh=None, fallback=True
    )
    assert step == 3
    torch.manual_seed(3)
    assert torch.equal(model.weight, nn.Linear(3, 2).weight)
    err = capsys.readouterr().err
    assert err.startswith(
        f"shard train: --resume latest-intact: {tmp_path}/step-6 is corrupt (__0_0.distcp does "
        "not match its checksum at bytes "
    )
    assert err.endswith(f"); resuming from {tmp_path}/step-3\n")
    assert data.exists()  # nothing is removed before a new checkpoint is in place
