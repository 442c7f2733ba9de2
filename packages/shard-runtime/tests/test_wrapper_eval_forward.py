"""A forward under ``torch.no_grad()`` (validation) leaves the wrapper's parameters in place.

With ``use_orig_params=True`` a unit computes with plain views in place of its
original parameters; under ``SHARD_GRAD_OP`` and ``NO_SHARD`` it stays unsharded
after forward. After a validation forward, ``named_parameters()`` must still
list every parameter, as the same objects the optimizer holds, so that code
between evaluation and the next step (``requires_grad_``, clipping, EMA,
logging) sees them: the differential tester found them missing.
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
from shard_testing.differential import Config
from shard_testing.differential._models import Net, batch_of


def _names_after_evaluation(impl: str, strategy: str) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    ns = fsdp_namespace(impl)  # type: ignore[arg-type]
    torch.manual_seed(0)
    config = Config()
    net = Net(config)
    kwargs: dict[str, Any] = {
        "sharding_strategy": ns.ShardingStrategy[strategy],
        "use_orig_params": True,
        "device_id": torch.device("cpu"),
    }
    net.blocks[0] = ns.FullyShardedDataParallel(net.blocks[0], **kwargs)
    model = ns.FullyShardedDataParallel(net, **kwargs)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens, targets = batch_of(config, 0, 0, dist.get_rank())

    def loss() -> torch.Tensor:
        logits = model(tokens, False)
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    loss().backward()
    optim.step()
    optim.zero_grad()
    before = dict(model.named_parameters())
    with torch.no_grad():
        evaluated = float(loss())
    after = dict(model.named_parameters())
    same_objects = [n for n in before if after.get(n) is before[n]]
    after["_fsdp_wrapped_module.embed.weight"].requires_grad_(False)
    loss().backward()
    with_grad = sorted(n for n, p in model.named_parameters() if p.grad is not None)
    return {
        "names": list(after),
        "same objects": same_objects == list(before),
        "evaluated": evaluated,
        "with_grad": with_grad,
    }


@pytest.mark.parametrize("strategy", ["SHARD_GRAD_OP", "NO_SHARD", "FULL_SHARD"])
def test_validation_forward_keeps_named_parameters(rank_pool: RankPool, strategy: str) -> None:
    """Every parameter is listed after a no_grad forward, as PyTorch lists it, and a freeze
    set through it holds in the next step."""
    theirs = rank_pool.run(_names_after_evaluation, 2, "torch", strategy)
    ours = rank_pool.run(_names_after_evaluation, 2, "shard", strategy)
    for our, their in zip(ours, theirs, strict=True):
        assert our["names"] == their["names"]
        assert len(our["names"]) == len(list(Net(Config()).parameters()))
        assert our["same objects"]
        assert our["evaluated"] == their["evaluated"]
        assert our["with_grad"] == their["with_grad"]  # a rank's empty pieces get none
        assert "_fsdp_wrapped_module.embed.weight" not in our["with_grad"]
    assert any("_fsdp_wrapped_module.head.weight" in our["with_grad"] for our in ours)
