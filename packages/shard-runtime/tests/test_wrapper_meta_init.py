"""A wrapped model built on the meta device and initialised by param_init_fn trains like eager.

Compared with one process trained on the concatenated batch (fp32:
``assert_close`` default tolerances).
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


def _init_like_eager(module: nn.Module) -> None:
    """Materialise ``module``'s subtree on the CPU and initialise it in construction order."""
    torch.manual_seed(0)  # ToyNet(seed=0) seeds the same way before building its layers
    module.to_empty(device=torch.device("cpu"))
    for m in module.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()


def _meta_init() -> dict[str, Any]:
    with torch.device("meta"):
        net = ToyNet()
    calls: list[str] = []

    def param_init_fn(module: nn.Module) -> None:
        calls.append(type(module).__name__)
        _init_like_eager(module)

    model = FSDP(net, auto_wrap_policy=PER_BLOCK, param_init_fn=param_init_fn)
    on_meta = [n for n, p in model.named_parameters() if p.is_meta]
    return {
        "calls": calls,
        "on_meta": on_meta,
        "losses": _train(model),
        "params": _full_params(model),
    }


def test_param_init_fn_on_meta_model_trains_like_eager(rank_pool: RankPool) -> None:
    """A ToyNet built on meta and initialised by param_init_fn trains like an eager ToyNet."""
    results = rank_pool.run(_meta_init, 2)
    for result in results:
        assert result["calls"] == ["ToyNet"]  # the root first: nothing left on meta after it
        assert result["on_meta"] == []
    _check_parity(results, 2)
