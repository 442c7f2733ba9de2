"""A wrapped model built on the meta device and initialised by param_init_fn trains like eager.

Compared with one process trained on the concatenated batch (fp32:
``assert_close`` default tolerances).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shard_runtime import FullyShardedDataParallel, ModuleWrapPolicy
from shard_testing import RankPool
from shard_testing.models import (
    ResidualBlock,
    ToyNet,
    check_toy_parity,
    train_toy,
    wrapper_full_params,
)

FSDP = FullyShardedDataParallel
PER_BLOCK = ModuleWrapPolicy({ResidualBlock})
STEPS = 3
PARAM_NAMES = [name for name, _ in ToyNet().named_parameters()]


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
        "losses": train_toy(model, STEPS),
        "params": wrapper_full_params(model, PARAM_NAMES),
    }


def test_param_init_fn_on_meta_model_trains_like_eager(rank_pool: RankPool) -> None:
    """A ToyNet built on meta and initialised by param_init_fn trains like an eager ToyNet."""
    results = rank_pool.run(_meta_init, 2)
    for result in results:
        assert result["calls"] == ["ToyNet"]  # the root first: nothing left on meta after it
        assert result["on_meta"] == []
    check_toy_parity(results, 2, STEPS)
