"""The wrapper's ignored_modules stay whole and unreduced; the rest trains like one process.

Compared with one process trained on the concatenated batch (fp32:
``assert_close`` default tolerances), as in every wrapper parity test.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shard_runtime import FullyShardedDataParallel, ModuleWrapPolicy
from shard_testing import RankPool
from shard_testing.models import (
    ResidualBlock,
    ToyNet,
    check_toy_parity,
    toy_batches,
    train_toy,
    wrapper_full_params,
)

FSDP = FullyShardedDataParallel
PER_BLOCK = ModuleWrapPolicy({ResidualBlock})
STEPS = 3
PARAM_NAMES = [name for name, _ in ToyNet().named_parameters()]


def _ignored_head(use_orig_params: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    net = ToyNet()
    head = net.head
    model = FSDP(
        net, auto_wrap_policy=PER_BLOCK, ignored_modules=[head], use_orig_params=use_orig_params
    )
    head_params = list(head.parameters())
    x, y = toy_batches(world, 1)[0][0][rank]
    nn.functional.mse_loss(model(x), y).backward()
    local_grads = [p.grad.clone() for p in head_params if p.grad is not None]
    model.zero_grad()

    def average_head() -> None:
        # Ignored parameters are the user's to reduce, as with a plain module.
        for p in head_params:
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad.div_(world)

    losses = train_toy(model, STEPS, average_head)
    return {
        "head_shapes": [tuple(p.shape) for p in head_params],
        "head_is_registered": [p is q for p, q in zip(head_params, head.parameters(), strict=True)],
        "ignored_in_parameters": sum(any(p is q for q in model.parameters()) for p in head_params),
        "local_grads": local_grads,
        "losses": losses,
        "params": wrapper_full_params(model, PARAM_NAMES),
    }


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_ignored_module_stays_whole_and_unreduced(
    rank_pool: RankPool, use_orig_params: bool
) -> None:
    """An ignored head keeps full parameters and local gradients; the rest trains with parity.

    Each rank's head gradient after one backward is that rank's own (the
    gradient of its own batch alone); averaging them by hand, as for any
    unsharded module, makes the whole model train like one process.
    """
    results = rank_pool.run(_ignored_head, 2, use_orig_params)
    batch = toy_batches(2, 1)[0][0]
    for rank, result in enumerate(results):
        assert result["head_shapes"] == [(3, 10), (3,)]
        assert result["head_is_registered"] == [True, True]
        assert result["ignored_in_parameters"] == 2
        ref = ToyNet()
        x, y = batch[rank]
        nn.functional.mse_loss(ref(x), y).backward()
        expected = [ref.head.weight.grad, ref.head.bias.grad]
        assert len(result["local_grads"]) == 2
        for got, want in zip(result["local_grads"], expected, strict=True):
            torch.testing.assert_close(got, want)
    assert not torch.equal(results[0]["local_grads"][0], results[1]["local_grads"][0])
    check_toy_parity(results, 2, STEPS)
