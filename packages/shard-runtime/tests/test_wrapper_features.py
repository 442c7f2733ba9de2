"""FullyShardedDataParallel's init features and tie folding train like one process.

Ignored modules, meta-device init through ``param_init_fn``,
``sync_module_states`` from different per-rank inits, and tied weights that a
policy would split: each runs on the shared rank pool and is compared with
one process trained on the concatenated batch (fp32: ``assert_close``
default tolerances), or with what an unsharded module holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
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


# ---------------------------------------------------------------------- ignored modules


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

    losses = _train(model, average_head)
    return {
        "head_shapes": [tuple(p.shape) for p in head_params],
        "head_is_registered": [p is q for p, q in zip(head_params, head.parameters(), strict=True)],
        "ignored_in_parameters": sum(any(p is q for q in model.parameters()) for p in head_params),
        "local_grads": local_grads,
        "losses": losses,
        "params": _full_params(model),
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
    _check_parity(results, 2)


# ---------------------------------------------------------------------- meta init


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


# ---------------------------------------------------------------------- sync_module_states


def _sync_states() -> dict[str, Any]:
    rank = dist.get_rank()
    net = ToyNet(seed=rank)
    net.register_buffer("scale", torch.full((3,), float(rank + 1)))
    model = FSDP(net, auto_wrap_policy=PER_BLOCK, sync_module_states=True)
    initial = _full_params(model)
    scale = model.scale.clone()
    return {
        "initial": initial,
        "scale": scale,
        "losses": _train(model),
        "params": _full_params(model),
    }


def test_sync_module_states_starts_every_rank_from_rank_0(rank_pool: RankPool) -> None:
    """Ranks seeded differently hold rank 0's parameters and buffers, then train with parity."""
    results = rank_pool.run(_sync_states, 2)
    rank0_init = dict(ToyNet(seed=0).named_parameters())
    assert not torch.equal(ToyNet(seed=1).embed.weight, rank0_init["embed.weight"])
    for result in results:
        for name, value in rank0_init.items():
            torch.testing.assert_close(result["initial"][name], value.detach(), rtol=0, atol=0)
        torch.testing.assert_close(result["scale"], torch.ones(3), rtol=0, atol=0)
    _check_parity(results, 2)


# ---------------------------------------------------------------------- tied parameters


VOCAB, WIDTH = 7, 4


class TiedLM(nn.Module):
    """An embedding and an output head that share one weight, around a hidden layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(ids))))


def _tied_batches(world: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [[torch.randint(0, VOCAB, (3, 5), generator=g) for _ in range(world)] for _ in range(3)]


def _tied_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1))


def _tied(use_orig_params: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = FSDP(
        TiedLM(),
        auto_wrap_policy=ModuleWrapPolicy({nn.Embedding, nn.Linear}),
        use_orig_params=use_orig_params,
    )
    units = [name for name, m in model.named_modules() if isinstance(m, FSDP)]
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = []
    for step in _tied_batches(world):
        loss = _tied_loss(model(step[rank]), step[rank])
        loss.backward()
        optim.step()
        optim.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    with FSDP.summon_full_params(model, writeback=False):
        tied = model.head.weight is model.embed.weight
        params = {
            "embed.weight": model.embed.weight.detach().clone(),
            "hidden.weight": model.hidden.weight.detach().clone(),
            "hidden.bias": model.hidden.bias.detach().clone(),
        }
    return {"units": units, "losses": losses, "tied": tied, "params": params}


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_tied_weights_fold_into_one_unit_and_train_with_parity(
    rank_pool: RankPool, use_orig_params: bool
) -> None:
    """A policy wrapping Embedding and Linear would split the tie: both land in the root unit."""
    ref = TiedLM()
    optim = torch.optim.AdamW(ref.parameters(), lr=0.05)
    ref_losses = []
    for step in _tied_batches(2):
        ids = torch.cat(step)
        loss = _tied_loss(ref(ids), ids)
        loss.backward()
        optim.step()
        optim.zero_grad()
        ref_losses.append(float(loss.detach()))
    for result in rank_pool.run(_tied, 2, use_orig_params):
        assert result["units"] == ["", "_fsdp_wrapped_module.hidden"]
        assert result["tied"] is True
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses))
        for name, param in ref.named_parameters():
            torch.testing.assert_close(result["params"][name], param.detach())
