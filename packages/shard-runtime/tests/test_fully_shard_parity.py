"""fully_shard trains exactly like one process on the concatenated batch.

Each test runs the same model, seed and data on N gloo ranks of the shared
pool and in this process, then compares the loss of every step and the full
parameters at the end (fp32: ``assert_close`` default tolerances).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from shard_runtime import CPUOffloadPolicy, FSDPModule, fully_shard
from shard_testing import RankPool

STEPS = 3
BATCH = 4
DIM_IN, HIDDEN, DIM_OUT = 6, 10, 3  # 10 rows over 3 or 4 ranks: uneven shards


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(HIDDEN, 2 * HIDDEN + 1)
        self.outer = nn.Linear(2 * HIDDEN + 1, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(torch.tanh(self.inner(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM_IN, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(HIDDEN, DIM_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build() -> Net:
    torch.manual_seed(0)
    return Net()


def batches(
    world_size: int, microbatches: int = 1
) -> list[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """``[step][microbatch][rank] -> (x, y)``, the same in every process."""
    g = torch.Generator().manual_seed(1234)
    return [
        [
            [
                (torch.randn(BATCH, DIM_IN, generator=g), torch.randn(BATCH, DIM_OUT, generator=g))
                for _ in range(world_size)
            ]
            for _ in range(microbatches)
        ]
        for _ in range(STEPS)
    ]


def reference(
    world_size: int, microbatches: int = 1
) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build()
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = []
    for step in batches(world_size, microbatches):
        total = 0.0
        for micro in step:
            x = torch.cat([x for x, _ in micro])
            y = torch.cat([y for _, y in micro])
            loss = nn.functional.mse_loss(model(x), y) / microbatches
            loss.backward()
            total += loss.item()
        optim.step()
        optim.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(config: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    microbatches = config.get("microbatches", 1)
    if config.get("hsdp"):
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": config.get("reshard", True)}
    if config.get("offload"):
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    model = build()
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    blocks: list[FSDPModule] = [b for b in model.blocks]  # type: ignore[misc]
    if config.get("explicit_prefetch"):
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 3])
            block.set_modules_to_backward_prefetch(list(reversed(blocks[max(0, i - 2) : i])))
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = []
    for step in batches(world, microbatches):
        total = torch.zeros(())
        for index, micro in enumerate(step):
            last = index == microbatches - 1
            model.set_requires_gradient_sync(last)  # type: ignore[attr-defined]
            x, y = micro[rank]
            loss = nn.functional.mse_loss(model(x), y) / microbatches
            loss.backward()
            total += loss.detach()
        optim.step()
        optim.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return losses, full


def _check(
    results: list[tuple[list[float], dict[str, torch.Tensor]]], world: int, microbatches: int = 1
) -> None:
    ref_losses, ref_state = reference(world, microbatches)
    for losses, state in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        assert list(state) == list(ref_state)
        for key, value in ref_state.items():
            torch.testing.assert_close(state[key], value, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("reshard", [True, False])
def test_parity_world_sizes(rank_pool: RankPool, world: int, reshard: bool) -> None:
    """Losses and final parameters equal one process's at 1..4 ranks, resharding or not."""
    _check(rank_pool.run(_train, world, {"reshard": reshard}), world)


@pytest.mark.parametrize(("world", "reshard"), [(2, 2), (4, 2), (4, 1)])
def test_parity_reshard_after_forward_int(rank_pool: RankPool, world: int, reshard: int) -> None:
    """An int reshard_after_forward (the shard size, a smaller group, or 1) trains identically."""
    _check(rank_pool.run(_train, world, {"reshard": reshard}), world)


def test_parity_hybrid_2x2(rank_pool: RankPool) -> None:
    """A 2x2 (replicate, shard) mesh trains like one process on the four ranks' data."""
    _check(rank_pool.run(_train, 4, {"hsdp": True}), 4)


def test_parity_cpu_offload(rank_pool: RankPool) -> None:
    """CPUOffloadPolicy trains identically."""
    _check(rank_pool.run(_train, 2, {"offload": True}), 2)


def test_parity_gradient_accumulation(rank_pool: RankPool) -> None:
    """Three microbatches with gradient sync only on the last equal one process on all of them."""
    _check(rank_pool.run(_train, 2, {"microbatches": 3}), 2, microbatches=3)


def test_parity_explicit_prefetch(rank_pool: RankPool) -> None:
    """Prefetching two blocks ahead in forward and backward changes nothing numerically."""
    _check(rank_pool.run(_train, 3, {"explicit_prefetch": True}), 3)
