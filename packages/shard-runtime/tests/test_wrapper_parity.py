"""FullyShardedDataParallel trains exactly like one process on the concatenated batch.

Every strategy, both ``use_orig_params`` settings, each prefetch mode, CPU
offload, ``no_sync`` accumulation and ``clip_grad_norm_`` run on the shared
rank pool and are compared with one process: losses every step and the full
parameters at the end (fp32: ``assert_close`` default tolerances).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from shard_runtime import (
    BackwardPrefetch,
    CPUOffload,
    FullyShardedDataParallel,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
)
from shard_testing import RankPool
from shard_testing.models import ResidualBlock, ToyNet, toy_batches

STEPS = 3
FSDP = FullyShardedDataParallel


def reference(
    world: int, microbatches: int = 1, clip: float | None = None
) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    model = ToyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses, norms = [], []
    for step in toy_batches(world, STEPS, microbatches=microbatches):
        total = 0.0
        for micro in step:
            x = torch.cat([x for x, _ in micro])
            y = torch.cat([y for _, y in micro])
            loss = nn.functional.mse_loss(model(x), y) / microbatches
            loss.backward()
            total += float(loss.detach())
        if clip is not None:
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optim.step()
        optim.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def _full_state(model: FullyShardedDataParallel) -> dict[str, torch.Tensor]:
    with FSDP.summon_full_params(model, writeback=False):
        return {name: p.detach().clone() for name, p in _named_full(model)}


def _named_full(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The original parameters by their unwrapped names, as summon_full_params shows them."""
    inner = ToyNet()
    names = [n for n, _ in inner.named_parameters()]
    out = []
    for name in names:
        owner = model
        *path, leaf = name.split(".")
        for part in path:
            owner = owner[int(part)] if part.isdigit() else getattr(owner, part)
        out.append((name, getattr(owner, leaf)))
    return out


def _train(config: dict[str, Any]) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    microbatches = config.get("microbatches", 1)
    kwargs: dict[str, Any] = {
        "sharding_strategy": config.get("strategy", ShardingStrategy.FULL_SHARD),
        "use_orig_params": config.get("orig", False),
        "auto_wrap_policy": ModuleWrapPolicy({ResidualBlock}),
        "backward_prefetch": config.get("prefetch", BackwardPrefetch.BACKWARD_PRE),
        "forward_prefetch": config.get("forward_prefetch", False),
    }
    if config.get("hybrid"):
        kwargs["device_mesh"] = init_device_mesh(
            "cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")
        )
    if config.get("offload"):
        kwargs["cpu_offload"] = CPUOffload(offload_params=True)
    if config.get("bf16"):
        kwargs["mixed_precision"] = MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    model = FSDP(ToyNet(), **kwargs)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses, norms = [], []
    for step in toy_batches(world, STEPS, microbatches=microbatches):
        total = torch.zeros(())
        for index, micro in enumerate(step):
            x, y = micro[rank]
            context = model.no_sync() if index < microbatches - 1 else _nullcontext()
            with context:
                loss = nn.functional.mse_loss(model(x).float(), y) / microbatches
                loss.backward()
            total += loss.detach()
        if config.get("clip") is not None:
            norms.append(float(model.clip_grad_norm_(config["clip"])))
        optim.step()
        optim.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return {
        "losses": losses,
        "state": _full_state(model),
        "norms": norms,
        "wrappers": len(FSDP.fsdp_modules(model)),
    }


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _check(results: list[dict[str, Any]], world: int, microbatches: int = 1, **tol: Any) -> None:
    ref_losses, ref_state, _ = reference(world, microbatches)
    for result in results:
        assert result["wrappers"] == 4  # three blocks and the root
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), **tol)
        assert sorted(result["state"]) == sorted(ref_state)
        for key, value in ref_state.items():
            torch.testing.assert_close(result["state"][key], value, **tol)


STRATEGIES = [
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.NO_SHARD,
]


@pytest.mark.parametrize("orig", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_parity_strategies(rank_pool: RankPool, strategy: ShardingStrategy, orig: bool) -> None:
    """FULL_SHARD, SHARD_GRAD_OP and NO_SHARD, flat or original parameters, on 3 uneven ranks."""
    _check(rank_pool.run(_train, 3, {"strategy": strategy, "orig": orig}), 3)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_parity_world_sizes(rank_pool: RankPool, world: int) -> None:
    """FULL_SHARD matches one process at 1, 2 and 4 ranks."""
    _check(rank_pool.run(_train, world, {}), world)


@pytest.mark.parametrize(
    "strategy", [ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2]
)
def test_parity_hybrid_2x2(rank_pool: RankPool, strategy: ShardingStrategy) -> None:
    """Hybrid sharding on a 2x2 mesh trains like one process on the four ranks' data."""
    _check(rank_pool.run(_train, 4, {"strategy": strategy, "hybrid": True}), 4)


@pytest.mark.parametrize(
    ("prefetch", "forward"),
    [(BackwardPrefetch.BACKWARD_POST, False), (None, False), (BackwardPrefetch.BACKWARD_PRE, True)],
    ids=["backward_post", "no_prefetch", "forward_prefetch"],
)
def test_parity_prefetch_modes(
    rank_pool: RankPool, prefetch: BackwardPrefetch | None, forward: bool
) -> None:
    """Each backward prefetch mode and forward prefetch leave the numbers unchanged."""
    _check(rank_pool.run(_train, 2, {"prefetch": prefetch, "forward_prefetch": forward}), 2)


def test_parity_cpu_offload(rank_pool: RankPool) -> None:
    """CPUOffload(offload_params=True) trains identically."""
    _check(rank_pool.run(_train, 2, {"offload": True, "orig": True}), 2)


def test_parity_no_sync_accumulation(rank_pool: RankPool) -> None:
    """Three microbatches, the first two under no_sync(), equal one process on all three."""
    _check(rank_pool.run(_train, 2, {"microbatches": 3}), 2, microbatches=3)


def test_clip_grad_norm_returns_single_process_norm(rank_pool: RankPool) -> None:
    """clip_grad_norm_ returns the single-process global norm every step and clips identically."""
    _, _, ref_norms = reference(3, clip=0.05)
    for result in rank_pool.run(_train, 3, {"clip": 0.05}):
        torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(ref_norms))


def test_bf16_mixed_precision_tracks_fp32(rank_pool: RankPool) -> None:
    """bf16 parameters, fp32 reduction: losses follow fp32 to bf16 precision; params stay fp32."""
    ref_losses, _, _ = reference(2)
    for result in rank_pool.run(_train, 2, {"bf16": True}):
        assert {v.dtype for v in result["state"].values()} == {torch.float32}
        losses = torch.tensor(result["losses"])
        torch.testing.assert_close(losses, torch.tensor(ref_losses), rtol=2e-2, atol=2e-2)
        assert not torch.equal(losses, torch.tensor(ref_losses))  # bf16 really computed
