"""The wrapper's sync_module_states starts every rank from rank 0's parameters and buffers.

Ranks seeded differently then train like one process on the concatenated
batch (fp32: ``assert_close`` default tolerances).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shard_runtime import FullyShardedDataParallel, ModuleWrapPolicy
from shard_testing import RankPool
from shard_testing.models import (
    ResidualBlock,
    ToyNet,
    check_toy_parity,
    train_toy,
    wrapper_full_params,
)

FSDP = FullyShardedDataParallel
PER_BLOCK = ModuleWrapPolicy({ResidualBlock})
STEPS = 3
PARAM_NAMES = [name for name, _ in ToyNet().named_parameters()]


def _sync_states() -> dict[str, Any]:
    rank = dist.get_rank()
    net = ToyNet(seed=rank)
    net.register_buffer("scale", torch.full((3,), float(rank + 1)))
    model = FSDP(net, auto_wrap_policy=PER_BLOCK, sync_module_states=True)
    initial = wrapper_full_params(model, PARAM_NAMES)
    scale = model.scale.clone()
    return {
        "initial": initial,
        "scale": scale,
        "losses": train_toy(model, STEPS),
        "params": wrapper_full_params(model, PARAM_NAMES),
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
    check_toy_parity(results, 2, STEPS)
