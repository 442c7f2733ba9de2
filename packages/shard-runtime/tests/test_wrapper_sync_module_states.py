"""The wrapper's sync_module_states starts every rank from rank 0's parameters and buffers.

Ranks seeded differently then train like one process on the concatenated
batch (fp32: ``assert_close`` default tolerances).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shard_runtime import FullyShardedDataParallel, ModuleWrapPolicy
from shard_testing import RankPool
from shard_testing.models import ResidualBlock, ToyNet, toy_batches

FSDP = FullyShardedDataParallel
PER_BLOCK = ModuleWrapPolicy({ResidualBlock})
STEPS = 3
PARAM_NAMES = [name for name, _ in ToyNet().named_parameters()]


def _reference(
    world: int, model: nn.Module | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses per step and final parameters of one process on the concatenated batches."""
    model = model if model is not None else ToyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = []
    for step in toy_batches(world, STEPS):
        x = torch.cat([x for x, _ in step[0]])
        y = torch.cat([y for _, y in step[0]])
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _full_params(model: FullyShardedDataParallel) -> dict[str, torch.Tensor]:
    """The original parameters by their unwrapped names, read inside summon_full_params."""
    out = {}
    with FSDP.summon_full_params(model, writeback=False):
        for name in PARAM_NAMES:
            owner: Any = model
            *path, leaf = name.split(".")
            for part in path:
                owner = owner[int(part)] if part.isdigit() else getattr(owner, part)
            out[name] = getattr(owner, leaf).detach().clone()
    return out


def _train(
    model: FullyShardedDataParallel, after_backward: Callable[[], None] | None = None
) -> list[float]:
    """STEPS of AdamW on this rank's slice of the toy batches; the mean loss of the ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = []
    for step in toy_batches(world, STEPS):
        x, y = step[0][rank]
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if after_backward is not None:
            after_backward()
        optim.step()
        optim.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _check_parity(results: list[dict[str, Any]], world: int) -> None:
    ref_losses, ref_params = _reference(world)
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses))
        assert list(result["params"]) == PARAM_NAMES
        for name, value in ref_params.items():
            torch.testing.assert_close(result["params"][name], value)


def _sync_states() -> dict[str, Any]:
    rank = dist.get_rank()
    net = ToyNet(seed=rank)
    net.register_buffer("scale", torch.full((3,), float(rank + 1)))
    model = FSDP(net, auto_wrap_policy=PER_BLOCK, sync_module_states=True)
    initial = _full_params(model)
    scale = model.scale.clone()
    return {
        "initial": initial,
        "scale": scale,
        "losses": _train(model),
        "params": _full_params(model),
    }


def test_sync_module_states_starts_every_rank_from_rank_0(rank_pool: RankPool) -> None:
    """Ranks seeded differently hold rank 0's parameters and buffers, then train with parity."""
    results = rank_pool.run(_sync_states, 2)
    rank0_init = dict(ToyNet(seed=0).named_parameters())
    assert not torch.equal(ToyNet(seed=1).embed.weight, rank0_init["embed.weight"])
    for result in results:
        for name, value in rank0_init.items():
            torch.testing.assert_close(result["initial"][name], value.detach(), rtol=0, atol=0)
        torch.testing.assert_close(result["scale"], torch.ones(3), rtol=0, atol=0)
    _check_parity(results, 2)
