"""Full state dicts load into tensor-parallel models sharded again by ``fully_shard``.

Parameters split over "tp" by ``parallelize_module`` and then over "dp" by
``fully_shard`` carry ``_StridedShard`` placements; each rank cuts its piece
of a full value by DTensor's own rule. PyTorch's ``set_model_state_dict``
refuses such a model (an ``AssertionError``); the test records that and
checks that shard's load is exact.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from shard_testing import RankPool
from shard_testing.compat import TPModel


def _load_full_into_tp(impl: str) -> dict[str, Any]:
    """Train 2 steps on a (dp 2, tp 2) mesh, load the full state dict into a fresh model."""
    if impl == "torch":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            set_model_state_dict,
        )
        from torch.distributed.fsdp import fully_shard
    else:
        from shard_checkpoint import StateDictOptions, get_model_state_dict, set_model_state_dict
        from shard_runtime import fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = TPModel()
        for block in model.blocks:
            plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
            parallelize_module(block, mesh["tp"], plan)  # type: ignore[arg-type]
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model

    def step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> float:
        g = torch.Generator().manual_seed(100 * seed + dist.get_rank() // 2)
        loss = nn.functional.mse_loss(model(torch.randn(4, 8, generator=g)), torch.zeros(4, 3))
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss.item()

    model = build(0)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for seed in range(2):
        step(model, optim, seed)
    options = StateDictOptions(full_state_dict=True)
    full = get_model_state_dict(model, options=options)
    fresh = build(1)
    try:
        set_model_state_dict(fresh, full, options=options)
    except Exception as exc:
        return {"error": type(exc).__name__}
    placements = {}
    equal = {}
    for (name, mine), theirs in zip(fresh.named_parameters(), model.parameters(), strict=True):
        assert isinstance(mine, DTensor)
        assert isinstance(theirs, DTensor)
        placements[name] = [str(p) for p in mine.placements]
        equal[name] = torch.equal(mine.to_local(), theirs.to_local())
    next_losses = [
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), 2),
        step(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), 2),
    ]
    return {"error": None, "placements": placements, "equal": equal, "losses": next_losses}


def test_full_state_dict_loads_into_strided_tensor_parallel_params(rank_pool: RankPool) -> None:
    """A trained dp x tp model's full state dict loads into a fresh one bitwise equal on every
    rank (``_StridedShard`` placements included) and gives the same next-step loss; PyTorch's
    set_model_state_dict raises an AssertionError on the same model."""
    theirs = rank_pool.run(_load_full_into_tp, 4, "torch")
    assert {r["error"] for r in theirs} == {"AssertionError"}
    ours = rank_pool.run(_load_full_into_tp, 4, "shard")
    for result in ours:
        assert result["error"] is None
        assert result["placements"]["blocks.0.up.weight"] == ["_S(0, 2)", "S(0)"]
        assert all(result["equal"].values()), result["equal"]
        assert result["losses"][0] == result["losses"][1]
