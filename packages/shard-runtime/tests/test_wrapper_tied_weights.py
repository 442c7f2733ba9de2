"""Tied weights a wrap policy would split fold into one wrapper unit and train like one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shard_runtime import FullyShardedDataParallel, ModuleWrapPolicy
from shard_testing import RankPool

FSDP = FullyShardedDataParallel
VOCAB, WIDTH = 7, 4


class TiedLM(nn.Module):
    """An embedding and an output head that share one weight, around a hidden layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(ids))))


def _tied_batches(world: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [[torch.randint(0, VOCAB, (3, 5), generator=g) for _ in range(world)] for _ in range(3)]


def _tied_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1))


def _tied(use_orig_params: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = FSDP(
        TiedLM(),
        auto_wrap_policy=ModuleWrapPolicy({nn.Embedding, nn.Linear}),
        use_orig_params=use_orig_params,
    )
    units = [name for name, m in model.named_modules() if isinstance(m, FSDP)]
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = []
    for step in _tied_batches(world):
        loss = _tied_loss(model(step[rank]), step[rank])
        loss.backward()
        optim.step()
        optim.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    with FSDP.summon_full_params(model, writeback=False):
        tied = model.head.weight is model.embed.weight
        params = {
            "embed.weight": model.embed.weight.detach().clone(),
            "hidden.weight": model.hidden.weight.detach().clone(),
            "hidden.bias": model.hidden.bias.detach().clone(),
        }
    return {"units": units, "losses": losses, "tied": tied, "params": params}


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_tied_weights_fold_into_one_unit_and_train_with_parity(
    rank_pool: RankPool, use_orig_params: bool
) -> None:
    """A policy wrapping Embedding and Linear would split the tie: both land in the root unit."""
    ref = TiedLM()
    optim = torch.optim.AdamW(ref.parameters(), lr=0.05)
    ref_losses = []
    for step in _tied_batches(2):
        ids = torch.cat(step)
        loss = _tied_loss(ref(ids), ids)
        loss.backward()
        optim.step()
        optim.zero_grad()
        ref_losses.append(float(loss.detach()))
    for result in rank_pool.run(_tied, 2, use_orig_params):
        assert result["units"] == ["", "_fsdp_wrapped_module.hidden"]
        assert result["tied"] is True
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses))
        for name, param in ref.named_parameters():
            torch.testing.assert_close(result["params"][name], param.detach())
