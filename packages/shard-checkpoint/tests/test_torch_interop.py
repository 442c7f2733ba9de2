"""Checkpoints move between PyTorch's own fully_shard and shard's, both ways, bit for bit.

PyTorch's FSDP2 and its ``torch.distributed.checkpoint.state_dict`` helpers
appear here only, as the reference. Both sides shard ``ToyNet`` the same way
(each block, then the root) on the same 2-rank mesh, shard's side with
``fully_shard`` or with its wrapper (flat shards, same units); the model and AdamW
state saved by one side load into a freshly built, zeroed model (and a
fresh optimizer) of the other, and the gathered values must be equal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict as torch_get_model_state_dict,
)
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict as torch_get_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict import (
    set_model_state_dict as torch_set_model_state_dict,
)
from torch.distributed.checkpoint.state_dict import (
    set_optimizer_state_dict as torch_set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import shard_checkpoint as sc
from shard_runtime import FullyShardedDataParallel as FSDP
from shard_runtime import ModuleWrapPolicy, fully_shard
from shard_testing import RankPool
from shard_testing.models import ResidualBlock, ToyNet, sharded_toy_net, toy_batches

Full = dict[str, torch.Tensor]


def _build(side: str, *, zeroed: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``side``: "torch" (PyTorch's fully_shard), "fully_shard" or "wrapper" (shard's)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model: nn.Module
    if side == "wrapper":
        model = FSDP(ToyNet(), auto_wrap_policy=ModuleWrapPolicy({ResidualBlock}), device_mesh=mesh)
    else:
        shard = torch_fully_shard if side == "torch" else fully_shard
        model = sharded_toy_net(shard, mesh=mesh)
    if zeroed:
        with torch.no_grad(), FSDP.summon_full_params(model):
            for param in model.parameters():
                param.zero_()
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _train_one_step(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    (x, y) = toy_batches(dist.get_world_size(), steps=1)[0][0][dist.get_rank()]
    nn.functional.mse_loss(model(x), y).backward()
    optim.step()
    optim.zero_grad()


def _gathered(model: nn.Module, optim: torch.optim.Optimizer) -> tuple[Full, Full]:
    """Full parameters, and full optimizer state as ``{"<fqn>.<name>": tensor}``."""
    if isinstance(model, FSDP):  # flat shards: gathered by shard-checkpoint, under real names
        full = sc.StateDictOptions(full_state_dict=True)
        osd = sc.get_optimizer_state_dict(model, optim, options=full)
        return sc.get_model_state_dict(model, options=full), {
            f"{fqn}.{name}": value for fqn, v in osd["state"].items() for name, value in v.items()
        }
    params = {k: v.full_tensor() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    state: Full = {}
    for param, values in optim.state.items():
        for name, value in values.items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            state[f"{names[id(param)]}.{name}"] = full
    return params, state


def _torch_to_shard(path: str, side: str) -> tuple[tuple[Full, Full], tuple[Full, Full]]:
    model, optim = _build("torch", zeroed=False)
    _train_one_step(model, optim)
    dcp.save(
        {
            "model": torch_get_model_state_dict(model),
            "optim": torch_get_optimizer_state_dict(model, optim),
        },
        checkpoint_id=path,
    )
    ours, our_optim = _build(side, zeroed=True)
    state: dict[str, Any] = {
        "model": sc.get_model_state_dict(ours),
        "optim": sc.get_optimizer_state_dict(ours, our_optim),
    }
    sc.load(state, checkpoint_id=path)
    sc.set_model_state_dict(ours, state["model"])
    sc.set_optimizer_state_dict(ours, our_optim, state["optim"])
    return _gathered(model, optim), _gathered(ours, our_optim)


def _shard_to_torch(path: str, side: str) -> tuple[tuple[Full, Full], tuple[Full, Full]]:
    ours, our_optim = _build(side, zeroed=False)
    _train_one_step(ours, our_optim)
    sc.save(
        {
            "model": sc.get_model_state_dict(ours),
            "optim": sc.get_optimizer_state_dict(ours, our_optim),
        },
        checkpoint_id=path,
    )
    model, optim = _build("torch", zeroed=True)
    state: dict[str, Any] = {
        "model": torch_get_model_state_dict(model),
        "optim": torch_get_optimizer_state_dict(model, optim),
    }
    dcp.load(state, checkpoint_id=path)
    torch_set_model_state_dict(model, state["model"])
    torch_set_optimizer_state_dict(model, optim, state["optim"])
    return _gathered(ours, our_optim), _gathered(model, optim)


def _assert_equal(got: Full, want: Full) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize("side", ["fully_shard", "wrapper"])
def test_torch_fully_shard_checkpoint_loads_into_shard(
    rank_pool: RankPool, tmp_path: Path, side: str
) -> None:
    """Model and AdamW state saved from PyTorch's fully_shard load bit-identically into shard's
    fully_shard, and into shard's wrapper (flat shards)."""
    for (params, state), (got_params, got_state) in rank_pool.run(
        _torch_to_shard, 2, str(tmp_path / "ckpt"), side
    ):
        assert len(state) == 3 * len(params)  # step, exp_avg, exp_avg_sq per parameter
        _assert_equal(got_params, params)
        _assert_equal(got_state, state)


@pytest.mark.parametrize("side", ["fully_shard", "wrapper"])
def test_shard_checkpoint_loads_into_torch_fully_shard(
    rank_pool: RankPool, tmp_path: Path, side: str
) -> None:
    """Model and AdamW state saved from shard's fully_shard or wrapper load bit-identically into
    PyTorch's fully_shard."""
    for (params, state), (got_params, got_state) in rank_pool.run(
        _shard_to_torch, 2, str(tmp_path / "ckpt"), side
    ):
        assert len(state) == 3 * len(params)
        _assert_equal(got_params, params)
        _assert_equal(got_state, state)
