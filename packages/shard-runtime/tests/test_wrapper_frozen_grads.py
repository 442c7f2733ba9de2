"""A parameter frozen under the wrapper stops training, even with zero-filled gradients kept.

``optimizer.zero_grad(set_to_none=False)`` leaves every gradient a tensor of
zeros. In a plain model a parameter frozen after that keeps its zero
gradient, so SGD's momentum (and weight decay) keep moving it. PyTorch's
wrapper with ``use_orig_params=True`` drops the gradient of every parameter
with ``requires_grad=False`` when its unit's reduction lands, so the
optimizer skips it and the freeze holds. shard's wrapper kept the zeros and
went on stepping the frozen parameter: the differential tester found it
(``set_to_none=False`` crossed with a freeze between steps).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shard_testing import RankPool
from shard_testing.compat import fsdp_namespace
from shard_testing.differential import BlockSpec, Config
from shard_testing.differential._models import Net, batch_of

FROZEN = "blocks.0.up.weight"
STEPS = 3


def _train(impl: str, strategy: str) -> dict[str, Any]:
    """Train three steps, freezing FROZEN after the first; the values and gradients seen."""
    warnings.simplefilter("ignore")
    ns = fsdp_namespace(impl)  # type: ignore[arg-type]
    torch.manual_seed(0)
    config = Config(blocks=(BlockSpec(), BlockSpec()))
    net = Net(config)
    kwargs: dict[str, Any] = {
        "sharding_strategy": ns.ShardingStrategy[strategy],
        "use_orig_params": True,
        "device_id": torch.device("cpu"),
    }
    for index, block in enumerate(net.blocks):
        net.blocks[index] = ns.FullyShardedDataParallel(block, **kwargs)
    model = ns.FullyShardedDataParallel(net, **kwargs)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params = {n.replace("_fsdp_wrapped_module.", ""): p for n, p in model.named_parameters()}
    seen: dict[str, Any] = {"values": [], "grad_none": []}
    for step in range(STEPS):
        if step == 1:
            params[FROZEN].requires_grad_(False)
        tokens, targets = batch_of(config, step, 0, dist.get_rank())
        logits = model(tokens, False)
        nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        seen["grad_none"].append(sorted(n for n, p in params.items() if p.grad is None))
        optim.step()
        optim.zero_grad(set_to_none=False)
        seen["values"].append({n: p.detach().clone().tolist() for n, p in params.items()})
    return seen


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_a_parameter_frozen_with_zero_grads_stops_training(
    rank_pool: RankPool, strategy: str
) -> None:
    """Gradients dropped and values kept as PyTorch's wrapper, step by step, bit for bit."""
    theirs = rank_pool.run(_train, 2, "torch", strategy)
    ours = rank_pool.run(_train, 2, "shard", strategy)
    for our, their in zip(ours, theirs, strict=True):
        assert our["grad_none"] == their["grad_none"]
        assert our["values"] == their["values"]
        # The freeze holds from the step it was set in: the value after step 0 stays.
        frozen = [values[FROZEN] for values in our["values"]]
        assert frozen[0] == frozen[1] == frozen[2]
    # Each rank that holds a piece of the frozen parameter had its zero gradient dropped.
    assert all(FROZEN in our["grad_none"][1] for our in ours)
