"""A sharded model, its hook state and its units are freed when the user drops the model."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from shard_runtime import FullyShardedDataParallel, ModuleWrapPolicy, fully_shard
from shard_runtime._state import get_state
from shard_testing import RankPool


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def _sharded(front_end: str) -> nn.Module:
    model = _model()
    if front_end == "wrapper":
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    return model


def _freed_after_del(front_end: str, steps: int) -> tuple[bool, bool]:
    """Whether the model and the state of its root unit survive ``del`` + ``gc.collect()``."""
    model = _sharded(front_end)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.ones(3, 4)).sum().backward()
        optim.step()
        optim.zero_grad()
    state = get_state(model)
    assert state is not None
    module_ref, state_ref = weakref.ref(model), weakref.ref(state)
    del model, optim, state
    gc.collect()
    return module_ref() is None, state_ref() is None


@pytest.mark.parametrize("front_end", ["fully_shard", "wrapper"])
@pytest.mark.parametrize("steps", [0, 2])
def test_model_is_freed_on_del(rank_pool: RankPool, front_end: str, steps: int) -> None:
    """Dropping a sharded model (before or after training steps) frees it and its hook state."""
    for module_freed, state_freed in rank_pool.run(_freed_after_del, 2, front_end, steps):
        assert module_freed, f"{front_end}: the model outlived del + gc.collect()"
        assert state_freed, f"{front_end}: the root's hook state outlived its model"


def _originals_alive_after_sharding(front_end: str) -> int:
    """How many of the model's original parameters outlive sharding, without a collection."""
    # torch.compiler.disable (every hook shard registers) imports torch._dynamo the first time,
    # and that import's torch.fx.wrap keeps every frame on the stack alive in a cycle until
    # the next collection: import it first, so only shard's own references are counted.
    import torch._dynamo  # noqa: F401

    model = _model()
    refs = [weakref.ref(p) for p in model.parameters()]
    gc.collect()
    gc.disable()  # what refcounting alone frees; see [Note: no recursive closures over parameters]
    try:
        if front_end == "wrapper":
            wrapped: nn.Module = FullyShardedDataParallel(
                model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear})
            )
        else:
            fully_shard(model[0])
            fully_shard(model[2])
            wrapped = fully_shard(model)
        alive = sum(ref() is not None for ref in refs)
        del wrapped
    finally:
        gc.enable()
    return alive


@pytest.mark.parametrize("front_end", ["fully_shard", "wrapper"])
def test_original_parameters_are_freed_by_sharding(rank_pool: RankPool, front_end: str) -> None:
    """Sharding drops the full original parameters at once, not at the next gc collection."""
    for alive in rank_pool.run(_originals_alive_after_sharding, 2, front_end):
        assert alive == 0, f"{front_end}: {alive} original parameters outlived sharding"
