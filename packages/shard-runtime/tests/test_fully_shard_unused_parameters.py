"""A parameter some ranks leave unused gets grad None or the others' mean, as in one process."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from shard_runtime import fully_shard
from shard_testing import RankPool


class _Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.use_b = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        return self.b(x) if self.use_b else x


def _rank_dependent_branch(users: list[int]) -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    inputs = [torch.arange(8.0).reshape(2, 4) + r for r in range(world)]
    torch.manual_seed(0)
    reference = _Branch()
    for r in range(world):
        reference.use_b = r in users
        (reference(inputs[r]).sum() / world).backward()
    torch.manual_seed(0)
    model = _Branch()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    model.use_b = rank in users
    model(inputs[rank]).sum().backward()
    grads = {}
    for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        if p.grad is None:
            grads[name] = None
        else:
            torch.testing.assert_close(p.grad.full_tensor(), ref.grad)
            grads[name] = "reference"
    return grads


def test_unused_parameter_grad_none_unless_another_rank_used_it(rank_pool: RankPool) -> None:
    """In one unit, a parameter no rank used keeps grad None; one some ranks used gets the mean."""
    for grads in rank_pool.run(_rank_dependent_branch, 2, []):
        assert grads == {
            "a.weight": "reference",
            "a.bias": "reference",
            "b.weight": None,
            "b.bias": None,
        }
    for grads in rank_pool.run(_rank_dependent_branch, 2, [1]):
        assert grads == dict.fromkeys(["a.weight", "a.bias", "b.weight", "b.bias"], "reference")
