"""fully_shard issues exactly the collectives PyTorch FSDP2 documents, one per unit.

Counts come from shard-comms' counters around one forward and one backward of
a model with three sharded blocks under a sharded root.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from shard_comms import count_collectives
from shard_runtime import fully_shard
from shard_testing import RankPool


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8),
        *(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)),
        nn.Linear(8, 2),
    )


def _count(reshard: bool, hsdp: bool) -> dict[str, Any]:
    world = dist.get_world_size()
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    model = _model()
    for block in list(model)[1:4]:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    # The root keeps its parameters for backward (None); True would reshard it too.
    fully_shard(model, mesh=mesh, reshard_after_forward=None if reshard else False)
    x = torch.randn(3, 4)
    with count_collectives() as forward:
        loss = model(x).sum()
    with count_collectives() as backward:
        loss.backward()
    kinds = ("all_gather", "reduce_scatter", "all_reduce")
    return {
        "forward": {k: forward.calls(k) for k in kinds},
        "backward": {k: backward.calls(k) for k in kinds},
        "labels": sorted(forward.labels()),
    }


@pytest.mark.parametrize(
    ("reshard", "backward_gathers"),
    [(True, 3), (False, 0)],
    ids=["reshard", "keep"],
)
def test_counts_per_step(rank_pool: RankPool, reshard: bool, backward_gathers: int) -> None:
    """Forward gathers blocks + root; backward regathers blocks if resharding; one reduce each."""
    for result in rank_pool.run(_count, 2, reshard, False):
        assert result["forward"] == {"all_gather": 4, "reduce_scatter": 0, "all_reduce": 0}
        assert result["backward"] == {
            "all_gather": backward_gathers,
            "reduce_scatter": 4,
            "all_reduce": 0,
        }
        assert result["labels"] == ["1", "2", "3", "Sequential"]


def _post_forward_group(size: int) -> dict[str, Any]:
    from shard_runtime._state import get_state

    model = _model()
    blocks = list(model)[1:4]
    for block in blocks:
        fully_shard(block, reshard_after_forward=size)
    fully_shard(model)  # the root keeps its parameters for backward
    loss = model(torch.randn(3, 4)).sum()
    states = [get_state(block) for block in blocks]
    kept = [s.unit._post_forward_shard.numel() for s in states if s is not None]
    per_rank = [s.unit.layout.gather_numel for s in states if s is not None]
    with count_collectives() as backward:
        loss.backward()
    return {
        "kept": kept,
        "per_rank": per_rank,
        "backward_gather_bytes": backward.bytes("all_gather"),
        "backward_gathers": backward.calls("all_gather"),
        "after": [s.unit._post_forward_shard for s in states if s is not None],
    }


def test_reshard_to_smaller_group(rank_pool: RankPool) -> None:
    """reshard_after_forward=2 on 4 ranks keeps half the parameters after forward for backward."""
    for result in rank_pool.run(_post_forward_group, 4, 2):
        assert result["kept"] == [2 * n for n in result["per_rank"]]
        assert result["backward_gathers"] == 3
        assert result["backward_gather_bytes"] == sum(4 * 4 * n for n in result["per_rank"])
        assert result["after"] == [None, None, None]


def test_counts_hybrid(rank_pool: RankPool) -> None:
    """On a 2x2 mesh each unit also all-reduces its reduced shard once across replicas."""
    for result in rank_pool.run(_count, 4, True, True):
        assert result["forward"] == {"all_gather": 4, "reduce_scatter": 0, "all_reduce": 0}
        assert result["backward"] == {"all_gather": 3, "reduce_scatter": 4, "all_reduce": 4}


def test_world_size_one_issues_no_collective(rank_pool: RankPool) -> None:
    """A single rank shards nothing across processes and makes no collective call."""
    (result,) = rank_pool.run(_count, 1, True, False)
    assert result["forward"] == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    assert result["backward"] == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
