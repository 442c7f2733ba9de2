"""A unit's full parameters are freed before its gradient reduction allocates its input.

Post-backward used to reduce first and reshard after, so for a moment each
unit held its full parameters, its full gradients and the reduce-scatter's
input together: one unit's full parameters more at the backward's peak than
PyTorch, which frees them first (found on the first GPU run as 24 MiB more
peak CUDA memory in an 8-layer model, then on the CPU as 4-6 MiB with
glibc's ``mallinfo2`` sampled after every operation of a backward). See
[Note: free, then reduce] in ``_state.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shard_runtime import (
    FullyShardedDataParallel,
    MixedPrecision,
    MixedPrecisionPolicy,
    ModuleWrapPolicy,
    fully_shard,
)
from shard_runtime._state import get_state, states_in
from shard_runtime._unit import Unit
from shard_testing import RankPool


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)]
    return nn.Sequential(*layers)


def _full_storage_bytes(unit: Unit) -> int:
    """Bytes the unit's full (unsharded) parameters hold right now, either layout."""
    layout = unit.layout
    params = getattr(layout, "params", None)
    tensors = [p.unsharded_param for p in params] if params is not None else [layout.unsharded]
    return sum(t.untyped_storage().nbytes() for t in tensors)


def _full_bytes_when_reducing(front_end: str, low: bool) -> list[int]:
    """For every reduction of one backward: the unit's full parameter bytes at its start."""
    model = _model()
    if front_end == "wrapper":
        sharded: nn.Module = FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16) if low else None,
        )
    else:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if low else None)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mp_policy=policy)
        sharded = fully_shard(model, mp_policy=policy)
    root = get_state(sharded)
    assert root is not None
    seen: list[int] = []
    for state in states_in(list(sharded.modules())):
        for unit in state.units:
            reduce_input = unit.layout.reduce_input

            def watched(*args: object, _unit: Unit = unit, _inner: object = reduce_input) -> object:
                seen.append(_full_storage_bytes(_unit))
                return _inner(*args)  # type: ignore[operator]

            unit.layout.reduce_input = watched  # type: ignore[method-assign]
    sharded(torch.ones(2, 8)).float().sum().backward()
    return seen


@pytest.mark.parametrize("front_end", ["fully_shard", "wrapper"])
@pytest.mark.parametrize("low", [False, True], ids=["fp32", "bf16"])
def test_full_parameters_are_freed_before_the_reduction_input_exists(
    rank_pool: RankPool, front_end: str, low: bool
) -> None:
    """Every unit (three layers, and the wrapper's root with nothing of its own) has
    released its full parameters when its reduce-scatter input is built, on both ranks."""
    for seen in rank_pool.run(_full_bytes_when_reducing, 2, front_end, low):
        assert len(seen) == 3, seen
        assert seen == [0, 0, 0], f"{front_end}: full parameter bytes at reduction: {seen}"
