"""A checkpoint saved from ``FullyShardedDataParallel`` loads into ``fully_shard`` and back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shard_checkpoint import (
    StateDictOptions,
    get_model_state_dict,
    load,
    save,
    set_model_state_dict,
)
from shard_runtime import FullyShardedDataParallel, ModuleWrapPolicy, fully_shard
from shard_testing import RankPool
from shard_testing.models import ResidualBlock, ToyNet, sharded_toy_net

FULL = StateDictOptions(full_state_dict=True)


def _wrapper(seed: int, use_orig_params: bool) -> FullyShardedDataParallel:
    return FullyShardedDataParallel(
        ToyNet(seed=seed),
        auto_wrap_policy=ModuleWrapPolicy({ResidualBlock}),
        use_orig_params=use_orig_params,
    )


def _fully_sharded(seed: int) -> ToyNet:
    return sharded_toy_net(fully_shard, seed=seed)


def _round_trip(root: str, use_orig_params: bool) -> dict[str, Any]:
    wrapped = _wrapper(0, use_orig_params)
    sharded = get_model_state_dict(wrapped)
    save({"model": sharded}, checkpoint_id=f"{root}/from-wrapper")
    target = _fully_sharded(1)
    state = {"model": get_model_state_dict(target)}
    load(state, checkpoint_id=f"{root}/from-wrapper")
    set_model_state_dict(target, state["model"])
    dist.barrier()
    save({"model": get_model_state_dict(target)}, checkpoint_id=f"{root}/from-fully-shard")
    back = _wrapper(2, use_orig_params)
    state = {"model": get_model_state_dict(back)}
    load(state, checkpoint_id=f"{root}/from-fully-shard")
    result = set_model_state_dict(back, state["model"])
    return {
        "placements": sorted(
            {str(v.placements) for v in sharded.values() if hasattr(v, "placements")}
        ),
        "fully_shard": get_model_state_dict(target, options=FULL),
        "wrapper": get_model_state_dict(back, options=FULL),
        "keys": (result.missing_keys, result.unexpected_keys),
    }


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_wrapper_checkpoint_loads_into_fully_shard_and_back(
    rank_pool: RankPool, tmp_path: Path, use_orig_params: bool
) -> None:
    """Wrapper -> checkpoint -> fully_shard -> checkpoint -> wrapper keeps every value exactly."""
    expected = {k: v.detach() for k, v in ToyNet(seed=0).state_dict().items()}
    for result in rank_pool.run(_round_trip, 2, str(tmp_path), use_orig_params):
        assert result["placements"] == ["(Shard(dim=0),)"]
        assert result["keys"] == ([], [])
        for name in ("fully_shard", "wrapper"):
            assert list(result[name]) == list(expected)
            for key, value in expected.items():
                torch.testing.assert_close(result[name][key], value, rtol=0, atol=0)
