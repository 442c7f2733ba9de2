"""A unit kept unsharded between forwards is not reused once its parameters were written.

After a forward, units stay gathered under ``SHARD_GRAD_OP``/``NO_SHARD``
(the wrapper's flat units) or ``reshard_after_forward=False``, and the
wrapper's root stays so after a forward with autograd on. PyTorch reuses that
copy at the next forward even when the parameters were written in between (an
optimizer step after a validation forward, weights swapped in around it,
``load_state_dict``): the write is silently lost. shard gathers again (see
[Note: a kept unsharded copy is checked before reuse] in ``_unit.py``), so the
reference here is shard without the evaluation, whose result the evaluation
must not change. An all-gather started and not waited for (``unshard(async_op=True)``,
a prefetch) is such a copy too: a write before the forward that consumes it is not lost.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shard_testing import RankPool
from shard_testing.compat import fsdp_namespace
from shard_testing.differential import Config
from shard_testing.differential._models import Net, batch_of

# (front end, sharding strategy or reshard_after_forward, use_orig_params)
_SETUPS = [
    ("wrapper", "FULL_SHARD", True),
    ("wrapper", "FULL_SHARD", False),
    ("wrapper", "SHARD_GRAD_OP", True),
    ("wrapper", "SHARD_GRAD_OP", False),
    ("wrapper", "NO_SHARD", True),
    ("fully_shard", "True", True),
    ("fully_shard", "False", True),
    ("fully_shard", "1", True),  # a post-forward group of one rank: the full rows kept
]
_RESHARD: dict[str, bool | int] = {"True": True, "False": False, "1": 1}


def _build(impl: str, front: str, strategy: str, use_orig_params: bool) -> nn.Module:
    warnings.simplefilter("ignore")
    ns = fsdp_namespace(impl)  # type: ignore[arg-type]
    torch.manual_seed(0)
    net = Net(Config())
    if front == "fully_shard":
        ns.fully_shard(net.blocks[0], reshard_after_forward=_RESHARD[strategy])
        model: nn.Module = ns.fully_shard(net, reshard_after_forward=_RESHARD[strategy])
        return model
    kwargs: dict[str, Any] = {
        "sharding_strategy": ns.ShardingStrategy[strategy],
        "use_orig_params": use_orig_params,
        "device_id": torch.device("cpu"),
    }
    net.blocks[0] = ns.FullyShardedDataParallel(net.blocks[0], **kwargs)
    wrapped: nn.Module = ns.FullyShardedDataParallel(net, **kwargs)
    return wrapped


def _halve(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)


def _step(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    optim.step()
    optim.zero_grad()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the model's state dict (the front end's own ``state_dict``)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


_BETWEEN: dict[str, Callable[[nn.Module, torch.optim.Optimizer], None]] = {
    "in-place edit": _halve,
    "optimizer step": _step,
    "load_state_dict": lambda model, optim: None,  # see _train: it needs the saved state
}


def _train(
    front: str,
    strategy: str,
    use_orig_params: bool,
    between: str,
    evaluate: bool,
    prefetch: bool = False,
) -> list[float]:
    """Train a step, maybe evaluate, write the parameters, train two steps; the losses.

    ``load_state_dict`` loads the state the model started from (a rollback). ``prefetch``
    starts the block's all-gather (``unshard(async_op=True)``, fully_shard) where the
    evaluation would run, and leaves it to the next forward."""
    model = _build("shard", front, strategy, use_orig_params)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    initial = _state(model) if between == "load_state_dict" else {}
    config = Config()
    tokens, targets = batch_of(config, 0, 0, dist.get_rank())

    def loss() -> torch.Tensor:
        logits = model(tokens, False)
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    loss().backward()
    if between != "optimizer step":
        _step(model, optim)
    if evaluate:
        with torch.no_grad():
            loss()
    if prefetch:
        block: Any = model.blocks[0]
        block.unshard(async_op=True)
    _BETWEEN[between](model, optim)
    if initial:
        model.load_state_dict(initial)
    losses = []
    for _ in range(2):
        value = loss()
        losses.append(float(value))
        value.backward()
        _step(model, optim)
    losses.append(float(loss()))
    return losses


@pytest.mark.parametrize("between", sorted(_BETWEEN))
@pytest.mark.parametrize(("front", "strategy", "use_orig_params"), _SETUPS)
def test_a_write_after_evaluation_reaches_the_next_forward(
    rank_pool: RankPool, front: str, strategy: str, use_orig_params: bool, between: str
) -> None:
    """An evaluation between two steps changes nothing, whatever writes the parameters
    after it: every loss equals the run without the evaluation, bit for bit."""
    args = (front, strategy, use_orig_params, between)
    expected = rank_pool.run(_train, 2, *args, False)
    evaluated = rank_pool.run(_train, 2, *args, True)
    assert evaluated == expected


@pytest.mark.parametrize("between", sorted(_BETWEEN))
@pytest.mark.parametrize("reshard", ["True", "False", "1"])
def test_a_write_after_a_prefetch_reaches_the_next_forward(
    rank_pool: RankPool, reshard: str, between: str
) -> None:
    """A block's all-gather started before its parameters are written, and left to the
    next forward, changes nothing: that forward gathers again (every loss equals the run
    without the prefetch, bit for bit)."""
    args = ("fully_shard", reshard, True, between, False)
    expected = rank_pool.run(_train, 2, *args)
    prefetched = rank_pool.run(_train, 2, *args, True)
    assert prefetched == expected


class _Adapted(nn.Module):
    """A trainable adapter ahead of a larger frozen layer, in one flat unit: with two ranks
    the adapter lies wholly in rank 0's half, so rank 1's pieces never get a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.adapter = nn.Linear(4, 4)
        self.base = nn.Linear(4, 64)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(self.adapter(x))


def _train_adapter(log_forward: bool) -> list[float]:
    """A step; maybe a loss computed for logging without a backward; an optimizer step."""
    warnings.simplefilter("ignore")
    ns = fsdp_namespace("shard")
    torch.manual_seed(0)
    model = ns.FullyShardedDataParallel(_Adapted(), use_orig_params=True)
    assert all(p.grad is None for p in model.parameters())
    optim = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    losses = []
    for _ in range(2):
        loss = model(x).square().mean()
        loss.backward()
        if log_forward:
            losses.append(float(model(x).square().mean()))  # kept for a backward never run
        optim.step()  # moves only rank 0's pieces
        optim.zero_grad()
        losses.append(float(model(x).square().mean().detach()))
    return losses


def test_ranks_agree_on_gathering_again_after_an_uneven_step(rank_pool: RankPool) -> None:
    """An optimizer step that writes only one rank's pieces (the other holds frozen ones)
    still makes both ranks gather the kept root again: they count optimizer steps, not
    only version counters, so their collectives match (else they would hang), and the
    losses are those of a run without the logging forwards."""
    expected = rank_pool.run(_train_adapter, 2, False, timeout=120)
    logged = rank_pool.run(_train_adapter, 2, True, timeout=120)
    assert [values[1::2] for values in logged] == expected


def _write_low_precision_face() -> list[str]:
    """fully_shard keeping bf16 faces: halve them after a validation forward, train on."""
    ns = fsdp_namespace("shard")
    torch.manual_seed(0)
    net = Net(Config())
    policy = ns.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = ns.fully_shard(net, reshard_after_forward=False, mp_policy=policy)
    tokens, _ = batch_of(Config(), 0, 0, dist.get_rank())
    with torch.no_grad():
        model(tokens, False)
        for p in model.parameters():
            p.mul_(0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(tokens, False).sum().backward()
    return [str(w.message) for w in caught if "written in place" in str(w.message)]


def test_a_write_to_a_low_precision_face_is_named(rank_pool: RankPool) -> None:
    """A write to a bf16 unsharded parameter cannot be carried to the fp32 shard exactly:
    a warning names the parameter and says how long the write holds."""
    messages = rank_pool.run(_write_low_precision_face, 2)[0]
    assert len(messages) == len(list(Net(Config()).parameters()))
    assert messages[0] == (
        "fully_shard: parameter 'embed.weight' was written in place while unsharded "
        "(between forwards that kept it gathered); its bfloat16 face (the shard is float32) "
        "cannot be carried to the shard exactly, so the write holds only until the module "
        "reshards (after its next backward). Write the sharded parameter instead: call "
        "reshard() on the module first."
    )
