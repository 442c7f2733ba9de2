"""SHARD_DEBUG=detail turns a rank-dependent unit order into an error on every rank, not a hang."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from shard_runtime import fully_shard
from shard_testing import RankPool


class _Swapping(nn.Module):
    """Runs its two blocks in an order that depends on the rank (a bug the check must catch)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (self.a, self.b) if dist.get_rank() == 0 else (self.b, self.a)
        return second(first(x))


def _swapped_order() -> str:
    os.environ["SHARD_DEBUG"] = "detail"
    model = _Swapping()
    fully_shard(model.a)
    fully_shard(model.b)
    fully_shard(model)
    try:
        model(torch.ones(1, 4)).sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_debug_order_check_catches_rank_dependent_order(rank_pool: RankPool) -> None:
    """With SHARD_DEBUG=detail a rank-dependent unit order raises on every rank, not a hang."""
    for message in rank_pool.run(_swapped_order, 2):
        assert message.startswith(
            "Forward order differs across ranks at unit position 1 of the first iteration"
        )
        assert "rank 0 runs 'a', rank 1 runs 'b'" in message
