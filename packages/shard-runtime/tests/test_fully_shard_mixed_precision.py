"""bf16 compute with fp32 gradient reduction follows a plain fp32 model to bf16 precision."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shard_runtime import MixedPrecisionPolicy, fully_shard
from shard_testing import RankPool


def _blocks_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))


def _bf16_train() -> list[float]:
    model = _blocks_model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model[2], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(3):
        xs = [torch.randn(4, 4, generator=g) for _ in range(dist.get_world_size())]
        loss = model(xs[dist.get_rank()]).float().pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        value = loss.detach()
        dist.all_reduce(value)
        losses.append(float(value) / dist.get_world_size())
    return losses


def test_bf16_training_tracks_fp32(rank_pool: RankPool) -> None:
    """bf16 compute with fp32 reduction follows the fp32 single-process losses to bf16 precision."""
    model = _blocks_model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    expected = []
    for _ in range(3):
        x = torch.cat([torch.randn(4, 4, generator=g) for _ in range(2)])
        loss = model(x).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        expected.append(float(loss.detach()))
    for losses in rank_pool.run(_bf16_train, 2):
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(expected), rtol=2e-2, atol=1e-2
        )
        assert losses != expected  # the compute really ran in bf16
