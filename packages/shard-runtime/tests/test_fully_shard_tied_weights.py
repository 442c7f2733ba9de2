"""Tied weights sharded as one unit by one fully_shard call train like one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shard_runtime import fully_shard
from shard_testing import RankPool

VOCAB, DIM = 11, 6


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(tokens))))


def _tokens(world: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    return [
        (torch.randint(0, VOCAB, (3, 5), generator=g), torch.randint(0, VOCAB, (3, 5), generator=g))
        for _ in range(world)
    ]


def _loss(model: nn.Module, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), target.reshape(-1))


def _train_tied(shard: bool, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Tied()
    world = dist.get_world_size() if shard else 2
    if shard:
        fully_shard(model.body)
        fully_shard([model.embed, model.head])
        fully_shard(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        batches = _tokens(world, step)
        if shard:
            tokens, target = batches[dist.get_rank()]
        else:
            tokens = torch.cat([b[0] for b in batches])
            target = torch.cat([b[1] for b in batches])
        loss = _loss(model, tokens, target)
        loss.backward()
        optim.step()
        optim.zero_grad()
        value = loss.detach()
        if shard:
            dist.all_reduce(value)
            value /= world
        losses.append(float(value))
    state = {
        k: v.full_tensor() if isinstance(v, DTensor) else v.detach()
        for k, v in model.state_dict().items()
    }
    return losses, state


def test_tied_weights_grouped_in_one_call(rank_pool: RankPool) -> None:
    """Embedding and head sharing a weight, sharded as one list, train like one process."""
    ref_losses, ref_state = _train_tied(False)
    for losses, state in rank_pool.run(_train_tied, 2, True):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        assert list(state) == [
            "embed.weight",
            "body.weight",
            "body.bias",
            "head.weight",
            "head.bias",
        ]
        for key, value in ref_state.items():
            torch.testing.assert_close(state[key], value)
