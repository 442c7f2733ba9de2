"""Sharded and full state dicts of fully_shard models survive save and load bit for bit.

Each rank function trains ``ToyNet`` one step (so the values are not those of
a fresh model), then saves or loads. Loads go into a freshly built model
whose parameters were zeroed first, so a value that was not loaded shows.
Checks compare full tensors gathered from the ranks with ``torch.equal``:
resharding moves bytes, it never computes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from shard_checkpoint import (
    StateDictOptions,
    consolidate,
    get_model_state_dict,
    load,
    save,
    set_model_state_dict,
)
from shard_runtime import MixedPrecisionPolicy, fully_shard
from shard_testing import RankPool
from shard_testing.models import ToyNet, data_parallel_mesh, sharded_toy_net, toy_batches

FULL = StateDictOptions(full_state_dict=True)


def _sharded_model(*, hybrid: bool = False, zeroed: bool = False) -> ToyNet:
    return sharded_toy_net(fully_shard, mesh=data_parallel_mesh(hybrid=hybrid), zeroed=zeroed)


def _trained_model(*, hybrid: bool = False) -> ToyNet:
    model = _sharded_model(hybrid=hybrid)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    (x, y) = toy_batches(dist.get_world_size(), steps=1)[0][0][dist.get_rank()]
    nn.functional.mse_loss(model(x), y).backward()
    optim.step()
    return model


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=FULL)


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


# ---------------------------------------------------------------- rank functions


def _save(path: str, hybrid: bool) -> dict[str, torch.Tensor]:
    model = _trained_model(hybrid=hybrid)
    save({"model": get_model_state_dict(model)}, checkpoint_id=path)
    return _full(model)


def _load(path: str, hybrid: bool) -> dict[str, Any]:
    model = _sharded_model(hybrid=hybrid, zeroed=True)
    state = {"model": get_model_state_dict(model)}
    load(state, checkpoint_id=path)
    result = set_model_state_dict(model, state["model"])
    weight = model.embed.weight  # 10 rows: 4, 4, 2 on 3 ranks
    assert isinstance(weight, DTensor)
    return {
        "full": _full(model),
        "incompatible": result,
        "placements": weight.placements,
        "local_rows": weight.to_local().shape[0],
    }


def _round_trip_sharded(path: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    saved = _save(path, hybrid=False)
    return saved, _load(path, hybrid=False)["full"]


def _round_trip_full() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    source = _trained_model()
    full = _full(source)
    target = _sharded_model(zeroed=True)
    set_model_state_dict(target, full, options=FULL)
    return full, _full(target)


def _mixed_precision_mid_step() -> dict[str, Any]:
    mesh = data_parallel_mesh()
    model = ToyNet()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    (x, y) = toy_batches(dist.get_world_size(), steps=1)[0][0][dist.get_rank()]
    nn.functional.mse_loss(model(x), y).backward()
    optim.step()
    before = _full(model)
    model(x)  # no backward: every unit still holds its bf16 unsharded parameters
    sharded = get_model_state_dict(model)
    return {
        "sharded": {k: (type(v).__name__, v.dtype) for k, v in sharded.items()},
        "before": before,
        "after": _full(model),
    }


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_state_dict_round_trips_through_a_checkpoint(
    rank_pool: RankPool, tmp_path: Path, world: int
) -> None:
    """DTensor shards saved with save() load back bit-identically at 1..4 ranks."""
    for saved, loaded in rank_pool.run(_round_trip_sharded, world, str(tmp_path / "ckpt")):
        _assert_equal(loaded, saved)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_full_state_dict_round_trips_into_shards(rank_pool: RankPool, world: int) -> None:
    """A full state dict set into a zeroed sharded model gives back the same full values."""
    for full, loaded in rank_pool.run(_round_trip_full, world):
        assert all(not isinstance(v, DTensor) for v in full.values())
        _assert_equal(loaded, full)


def test_checkpoint_saved_on_two_ranks_loads_on_three_and_on_one(
    rank_pool: RankPool, tmp_path: Path
) -> None:
    """Saved by 2 ranks, it loads on 3 (uneven shards) and into a plain model in this process."""
    path = str(tmp_path / "ckpt")
    saved = rank_pool.run(_save, 2, path, False)[0]
    for result in rank_pool.run(_load, 3, path, False):
        _assert_equal(result["full"], saved)
        assert result["incompatible"] == ([], [])
    assert [r["local_rows"] for r in rank_pool.run(_load, 3, path, False)] == [4, 4, 2]

    plain = ToyNet(seed=1)  # other values than the checkpoint's
    state = {"model": plain.state_dict()}
    load(state, checkpoint_id=path)  # no process group here: plain tensors, read whole
    plain.load_state_dict(state["model"])
    _assert_equal(plain.state_dict(), saved)

    out = consolidate(path, tmp_path / "model.pt", fmt="torch", prefix="model.")
    _assert_equal(torch.load(out, weights_only=True), saved)


def test_hybrid_2x2_checkpoint_loads_on_hybrid_and_on_flat_meshes(
    rank_pool: RankPool, tmp_path: Path
) -> None:
    """A (replicate, shard) 2x2 checkpoint loads into a 2x2 model and a 1-D 2-rank model."""
    path = str(tmp_path / "ckpt")
    saved = rank_pool.run(_save, 4, path, True)
    assert all(len(s) == len(saved[0]) for s in saved)
    for result in rank_pool.run(_load, 4, path, True):
        _assert_equal(result["full"], saved[0])
        assert result["placements"] == (Replicate(), Shard(0))
    for result in rank_pool.run(_load, 2, path, False):
        _assert_equal(result["full"], saved[0])
        assert result["placements"] == (Shard(0),)


def test_state_dicts_hold_full_precision_shards_even_mid_step(rank_pool: RankPool) -> None:
    """bf16 compute never leaks: fp32 DTensor shards, also right after a forward."""
    for result in rank_pool.run(_mixed_precision_mid_step, 2):
        assert set(result["sharded"].values()) == {("DTensor", torch.float32)}
        assert all(v.dtype == torch.float32 for v in result["after"].values())
        _assert_equal(result["after"], result["before"])
