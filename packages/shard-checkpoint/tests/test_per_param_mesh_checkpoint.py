"""State dicts and checkpoints of a model whose expert weights shard over a mesh of their own.

4 ranks, the torchtitan-style MoE of ``shard_testing.moe``: at expert
parallelism 2 the expert weights are DTensors on the ``(efsdp, ep)`` mesh (the
expert-data-parallel shard of an expert-parallel slice), the rest on the
data-parallel mesh of 4. Model and optimizer state saved there load at
expert parallelism 1 (every weight on the dp mesh) and 2: resharding moves
bytes, so full tensors compare exactly. Values cross processes as Python lists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shard_checkpoint import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    load,
    save,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from shard_runtime import FSDPMeshInfo, ShardPlacementResult, fully_shard
from shard_testing import RankPool
from shard_testing.moe import DIM, MoEModel, build_moe

FULL = StateDictOptions(full_state_dict=True)
EXPERT = "layers.0.experts.w1"


def _build(ep: int, seed: int) -> tuple[MoEModel, torch.optim.Optimizer]:
    model = build_moe(fully_shard, (ShardPlacementResult, FSDPMeshInfo), ep, seed=seed)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _plain(value: Any) -> Any:
    """Tensors (full ones, DTensors gathered) as nested lists; containers kept."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _full(model: MoEModel, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": _plain(get_model_state_dict(model, options=FULL)),
        "optim": _plain(get_optimizer_state_dict(model, optim, options=FULL)),
    }


def _save(path: str) -> dict[str, Any]:
    """One AdamW step at ep=2, then save; what was saved, and what the state dicts show."""
    model, optim = _build(ep=2, seed=0)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(4, DIM, generator=g), torch.randn(4, DIM, generator=g)
    nn.functional.mse_loss(model(x), y).backward()
    optim.step()
    module_state = model.state_dict()
    expert = module_state[EXPERT]
    assert isinstance(expert, DTensor)
    save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)},
        checkpoint_id=path,
    )
    saved = _full(model, optim)
    # The full state dict loads into a freshly initialised ep=2 model.
    target = _build(ep=2, seed=1)[0]
    set_model_state_dict(target, get_model_state_dict(model, options=FULL), options=FULL)
    return {
        **saved,
        "keys": list(module_state) == list(get_model_state_dict(model)),
        "expert_mesh": (
            expert.device_mesh.mesh_dim_names,
            expert.device_mesh.mesh.tolist(),
            [str(p) for p in expert.placements],
        ),
        "dense_mesh": module_state["layers.0.router.weight"].device_mesh.mesh.tolist(),
        "full_round_trip": _plain(get_model_state_dict(target, options=FULL)),
    }


def _load(path: str, ep: int) -> dict[str, Any]:
    """A differently initialised model at ``ep`` (optimizer state created) loads the checkpoint."""
    model, optim = _build(ep=ep, seed=1)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    expert = model.state_dict()[EXPERT]
    assert isinstance(expert, DTensor)
    return {**_full(model, optim), "expert_mesh": expert.device_mesh.mesh.tolist()}


def test_checkpoint_saved_at_ep2_loads_at_ep1_and_ep2(rank_pool: RankPool, tmp_path: Path) -> None:
    """Model and AdamW state saved with experts on (efsdp, ep) load exactly at EP=1 and EP=2;
    the full state dict round-trips; model.state_dict() has get_model_state_dict's keys."""
    path = str(tmp_path / "ckpt")
    saved = rank_pool.run(_save, 4, path)
    first = saved[0]
    assert all(s["model"] == first["model"] and s["optim"] == first["optim"] for s in saved)
    assert first["keys"] is True
    assert first["expert_mesh"] == (
        ("efsdp", "ep"),
        [[0, 1], [2, 3]],
        ["_S(0, 2)", "S(0)"],
    )
    assert first["dense_mesh"] == [0, 1, 2, 3]
    assert first["full_round_trip"] == first["model"]
    assert set(first["optim"]["state"]) == set(first["model"])
    for ep, expert_mesh in ((1, [0, 1, 2, 3]), (2, [[0, 1], [2, 3]])):
        for loaded in rank_pool.run(_load, 4, path, ep):
            assert loaded["model"] == first["model"], ep
            assert loaded["optim"] == first["optim"], ep
            assert loaded["expert_mesh"] == expert_mesh
