"""A forward under ``torch.no_grad()`` (validation) leaves the wrapper's parameters in place.

With ``use_orig_params=True`` a unit computes with plain views in place of its
original parameters; under ``SHARD_GRAD_OP`` and ``NO_SHARD`` it stays unsharded
after forward. After a validation forward, ``named_parameters()`` must still
list every parameter, as the same objects the optimizer holds, so that code
between evaluation and the next step (``requires_grad_``, clipping, EMA,
logging) sees them: the differential tester found them missing.
"""

from __future__ import annotations

import contextlib
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


def _names_after_evaluation(impl: str, strategy: str, no_grad: bool = True) -> dict[str, Any]:
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
    with torch.no_grad() if no_grad else contextlib.nullcontext():
        evaluated = float(loss())  # without no_grad: a graph dropped without a backward
    after = dict(model.named_parameters())
    same_objects = [n for n in before if after.get(n) is before[n]]
    after["_fsdp_wrapped_module.embed.weight"].requires_grad_(False)
    loss().backward()
    with_grad = sorted(n for n, p in model.named_parameters() if p.grad is not None)
    params = [p.detach().clone().tolist() for p in model.parameters()]
    return {
        "params": params,
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


@pytest.mark.parametrize("strategy", ["SHARD_GRAD_OP", "NO_SHARD", "FULL_SHARD"])
def test_a_forward_without_backward_keeps_named_parameters(
    rank_pool: RankPool, strategy: str
) -> None:
    """A loss computed with autograd on and dropped (its backward never runs) hides nothing:
    every parameter is listed, as the same objects, and training goes on exactly as after a
    no_grad evaluation. PyTorch lists the units' views there instead (requires_grad_ on
    them raises), so the reference is shard's own no_grad run."""
    reference = rank_pool.run(_names_after_evaluation, 2, "shard", strategy, True)
    dropped = rank_pool.run(_names_after_evaluation, 2, "shard", strategy, False)
    for ours, expected in zip(dropped, reference, strict=True):
        assert ours["names"] == expected["names"]
        assert len(ours["names"]) == len(list(Net(Config()).parameters()))
        assert ours["same objects"]
        assert ours["evaluated"] == expected["evaluated"]
        assert ours["with_grad"] == expected["with_grad"]
        assert "_fsdp_wrapped_module.embed.weight" not in ours["with_grad"]
        assert ours["params"] == expected["params"]
