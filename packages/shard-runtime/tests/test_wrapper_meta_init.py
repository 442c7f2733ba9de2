"""A wrapped model built on the meta device and initialised by param_init_fn trains like eager.

Compared with one process trained on the concatenated batch (fp32:
``assert_close`` default tolerances).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shard_runtime import FullyShardedDataParallel, ModuleWrapPolicy, StateDictType
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


class _TiedLM(nn.Module):
    """Embedding, a hidden layer and an output projection sharing the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.hidden = nn.Linear(8, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.hidden(self.embed(tokens))))
        return out


def _to_empty_alone(module: nn.Module) -> None:
    """accelerate's and transformers' param_init_fn: storage for this module's own tensors."""
    module.to_empty(device=torch.device("cpu"), recurse=False)


def _train_tied(model: nn.Module) -> dict[str, Any]:
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(int(torch.distributed.get_rank()))
    for _ in range(2):
        tokens = torch.randint(11, (4, 5), generator=generator)
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()  # type: ignore[no-untyped-call]
        optim.step()
        optim.zero_grad()
    inner: Any = model
    with FSDP.summon_full_params(model):
        return {
            "tied": inner.module.head.weight is inner.module.embed.weight,
            "names": [name for name, _ in model.named_parameters()],
            "embed": inner.module.embed.weight.detach().clone(),
        }


def _tied_from_meta(sync: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    eager = _TiedLM()
    pretrained = {k: v.clone() for k, v in eager.state_dict().items()}
    reference = _train_tied(FSDP(eager, use_orig_params=True))
    if sync and torch.distributed.get_rank() == 0:  # rank 0 loads, the others build on meta
        net = _TiedLM()
        net.load_state_dict(pretrained)
    else:
        with torch.device("meta"):
            net = _TiedLM()
    model = FSDP(net, use_orig_params=True, param_init_fn=_to_empty_alone, sync_module_states=sync)
    if not sync:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            model.load_state_dict(pretrained)
    return {"reference": reference, "meta": _train_tied(model)}


@pytest.mark.parametrize("sync", [True, False], ids=["rank-0-loads-and-syncs", "every-rank-loads"])
def test_param_init_fn_that_unties_keeps_tied_weights_tied(rank_pool: RankPool, sync: bool) -> None:
    """to_empty(recurse=False) per module gives the tied head its own tensor; shard ties it again.

    With sync_module_states, rank 0 built eagerly and the others on meta: the
    ranks must agree on the parameters (PyTorch's FSDP1 then fails or hangs in
    the broadcast); without it, the model must not train the two as separate
    parameters (PyTorch's does).
    """
    for result in rank_pool.run(_tied_from_meta, 2, sync):
        reference, meta = result["reference"], result["meta"]
        assert meta["tied"] is reference["tied"] is True
        assert meta["names"] == reference["names"]
        assert torch.equal(meta["embed"], reference["embed"])
