"""A sharded submodule runs forward and backward on its own once the root has run."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shard_runtime import fully_shard
from shard_testing import RankPool


def _blocks_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))


def _non_root(shard: bool) -> dict[str, torch.Tensor]:
    model = _blocks_model()
    if shard:
        fully_shard(model[2])
        fully_shard(model)
    model(torch.ones(2, 4)).sum().backward()
    model.zero_grad()
    model[2](torch.full((3, 6), 0.5)).pow(2).sum().backward()
    return {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def test_non_root_forward_and_backward(rank_pool: RankPool) -> None:
    """After the root's first step, a sharded submodule runs forward and backward on its own."""
    expected = _non_root(False)
    for grads in rank_pool.run(_non_root, 2, True):
        assert sorted(grads) == ["2.bias", "2.weight"]
        for key, value in expected.items():
            torch.testing.assert_close(grads[key], value)
