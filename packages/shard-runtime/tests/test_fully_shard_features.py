"""FSDPModule's controls and fully_shard's observability, each checked against a plain model."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from shard_comms import count_collectives
from shard_runtime import FSDPModule, MixedPrecisionPolicy, fully_shard
from shard_testing import RankPool

VOCAB, DIM = 11, 6


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(tokens))))


def _tokens(world: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    return [
        (torch.randint(0, VOCAB, (3, 5), generator=g), torch.randint(0, VOCAB, (3, 5), generator=g))
        for _ in range(world)
    ]


def _loss(model: nn.Module, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), target.reshape(-1))


def _train_tied(shard: bool, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Tied()
    world = dist.get_world_size() if shard else 2
    if shard:
        fully_shard(model.body)
        fully_shard([model.embed, model.head])
        fully_shard(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        batches = _tokens(world, step)
        if shard:
            tokens, target = batches[dist.get_rank()]
        else:
            tokens = torch.cat([b[0] for b in batches])
            target = torch.cat([b[1] for b in batches])
        loss = _loss(model, tokens, target)
        loss.backward()
        optim.step()
        optim.zero_grad()
        value = loss.detach()
        if shard:
            dist.all_reduce(value)
            value /= world
        losses.append(float(value))
    state = {
        k: v.full_tensor() if isinstance(v, DTensor) else v.detach()
        for k, v in model.state_dict().items()
    }
    return losses, state


def test_tied_weights_grouped_in_one_call(rank_pool: RankPool) -> None:
    """Embedding and head sharing a weight, sharded as one list, train like one process."""
    ref_losses, ref_state = _train_tied(False)
    for losses, state in rank_pool.run(_train_tied, 2, True):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        assert list(state) == [
            "embed.weight",
            "body.weight",
            "body.bias",
            "head.weight",
            "head.bias",
        ]
        for key, value in ref_state.items():
            torch.testing.assert_close(state[key], value)


def _blocks_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))


def _non_root(shard: bool) -> dict[str, torch.Tensor]:
    model = _blocks_model()
    if shard:
        fully_shard(model[2])
        fully_shard(model)
    model(torch.ones(2, 4)).sum().backward()
    model.zero_grad()
    model[2](torch.full((3, 6), 0.5)).pow(2).sum().backward()
    return {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def test_non_root_forward_and_backward(rank_pool: RankPool) -> None:
    """After the root's first step, a sharded submodule runs forward and backward on its own."""
    expected = _non_root(False)
    for grads in rank_pool.run(_non_root, 2, True):
        assert sorted(grads) == ["2.bias", "2.weight"]
        for key, value in expected.items():
            torch.testing.assert_close(grads[key], value)


def _controls() -> dict[str, Any]:
    model = _blocks_model()
    fully_shard(model[2])
    fully_shard(model)
    root: FSDPModule = model  # type: ignore[assignment]
    handle = root.unshard(async_op=True)
    assert handle is not None
    handle.wait()
    unsharded = [type(p).__name__ for p in model.parameters()]
    full_shape = tuple(model[0].weight.shape)
    root.reshard()
    resharded = [type(p).__name__ for p in model.parameters()]
    root.set_reshard_after_backward(False)
    model(torch.ones(2, 4)).sum().backward()
    kept = [isinstance(p, DTensor) for p in model[2].parameters()]
    with count_collectives() as counts:
        model(torch.ones(2, 4))
    root.set_reshard_after_backward(True)
    root.reshard()
    model[2].reshard()  # type: ignore[operator]
    return {
        "unsharded": unsharded,
        "full_shape": full_shape,
        "resharded": resharded,
        "kept_after_backward": kept,
        "gathers_when_kept": counts.calls("all_gather"),
    }


def test_unshard_reshard_and_keep_after_backward(rank_pool: RankPool) -> None:
    """unshard(async_op=True) registers full parameters; reshard_after_backward=False keeps them."""
    result = rank_pool.run(_controls, 2)[0]
    assert result["unsharded"] == ["Parameter"] * 2 + ["DTensor"] * 2 + ["Parameter"] * 2
    assert result["full_shape"] == (6, 4)
    assert result["resharded"] == ["DTensor"] * 6
    assert result["kept_after_backward"] == [False, False]
    assert result["gathers_when_kept"] == 0


def _deferred_all_reduce(defer: bool) -> dict[str, torch.Tensor]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _blocks_model()
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    root: FSDPModule = model  # type: ignore[assignment]
    g = torch.Generator().manual_seed(7)
    data = [torch.randn(4, 4, generator=g) for _ in range(2 * dist.get_world_size())]
    rank = dist.get_rank()
    with count_collectives() as counts:
        for micro in range(2):
            root.set_requires_all_reduce(not defer or micro == 1)
            model(data[2 * rank + micro]).sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    grads["all_reduces"] = torch.tensor(counts.calls("all_reduce"))
    return grads


def test_deferred_replica_all_reduce(rank_pool: RankPool) -> None:
    """set_requires_all_reduce(False) defers the replica all-reduce; the gradient is unchanged."""
    eager = rank_pool.run(_deferred_all_reduce, 4, False)[0]
    for deferred in rank_pool.run(_deferred_all_reduce, 4, True):
        assert int(eager["all_reduces"]) == 4
        assert int(deferred["all_reduces"]) == 2
        for key in ("0.weight", "2.weight", "4.bias"):
            torch.testing.assert_close(deferred[key], eager[key])


def _observability() -> dict[str, Any]:
    model = _blocks_model()
    fully_shard(model[2])
    fully_shard(model)
    logger = logging.getLogger("shard.comms")
    records: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = _Collect(level=logging.DEBUG)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    os.environ["SHARD_DEBUG"] = "1"
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model(torch.ones(2, 4)).sum().backward()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    names = sorted({e.name for e in prof.events() if e.name.startswith("shard::")})
    return {"ranges": names, "logs": sorted(set(records))}


def test_profiler_ranges_and_debug_log(rank_pool: RankPool) -> None:
    """Each collective shows as shard::<kind> (<module fqn>) in profiles and in SHARD_DEBUG logs."""
    result = rank_pool.run(_observability, 2)[0]
    assert result["ranges"] == [
        "shard::all_gather (2)",
        "shard::all_gather (Sequential)",
        "shard::reduce_scatter (2)",
        "shard::reduce_scatter (Sequential)",
    ]
    assert any(line.startswith("shard::all_gather (2) bytes=") for line in result["logs"])
    assert any(
        line.startswith("shard::reduce_scatter (Sequential) bytes=") for line in result["logs"]
    )


def _bf16_train() -> list[float]:
    model = _blocks_model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model[2], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(3):
        xs = [torch.randn(4, 4, generator=g) for _ in range(dist.get_world_size())]
        loss = model(xs[dist.get_rank()]).float().pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        value = loss.detach()
        dist.all_reduce(value)
        losses.append(float(value) / dist.get_world_size())
    return losses


def test_bf16_training_tracks_fp32(rank_pool: RankPool) -> None:
    """bf16 compute with fp32 reduction follows the fp32 single-process losses to bf16 precision."""
    model = _blocks_model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    expected = []
    for _ in range(3):
        x = torch.cat([torch.randn(4, 4, generator=g) for _ in range(2)])
        loss = model(x).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        expected.append(float(loss.detach()))
    for losses in rank_pool.run(_bf16_train, 2):
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(expected), rtol=2e-2, atol=1e-2
        )
        assert losses != expected  # the compute really ran in bf16


class _Swapping(nn.Module):
    """Runs its two blocks in an order that depends on the rank (a bug the check must catch)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (self.a, self.b) if dist.get_rank() == 0 else (self.b, self.a)
        return second(first(x))


def _swapped_order() -> str:
    os.environ["SHARD_DEBUG"] = "detail"
    model = _Swapping()
    fully_shard(model.a)
    fully_shard(model.b)
    fully_shard(model)
    try:
        model(torch.ones(1, 4)).sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_debug_order_check_catches_rank_dependent_order(rank_pool: RankPool) -> None:
    """With SHARD_DEBUG=detail a rank-dependent unit order raises on every rank, not a hang."""
    for message in rank_pool.run(_swapped_order, 2):
        assert message.startswith(
            "Forward order differs across ranks at unit position 1 of the first iteration"
        )
        assert "rank 0 runs 'a', rank 1 runs 'b'" in message


class _Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.use_b = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        return self.b(x) if self.use_b else x


def _rank_dependent_branch(users: list[int]) -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    inputs = [torch.arange(8.0).reshape(2, 4) + r for r in range(world)]
    torch.manual_seed(0)
    reference = _Branch()
    for r in range(world):
        reference.use_b = r in users
        (reference(inputs[r]).sum() / world).backward()
    torch.manual_seed(0)
    model = _Branch()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    model.use_b = rank in users
    model(inputs[rank]).sum().backward()
    grads = {}
    for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        if p.grad is None:
            grads[name] = None
        else:
            torch.testing.assert_close(p.grad.full_tensor(), ref.grad)
            grads[name] = "reference"
    return grads


def test_unused_parameter_grad_none_unless_another_rank_used_it(rank_pool: RankPool) -> None:
    """In one unit, a parameter no rank used keeps grad None; one some ranks used gets the mean."""
    for grads in rank_pool.run(_rank_dependent_branch, 2, []):
        assert grads == {
            "a.weight": "reference",
            "a.bias": "reference",
            "b.weight": None,
            "b.bias": None,
        }
    for grads in rank_pool.run(_rank_dependent_branch, 2, [1]):
        assert grads == dict.fromkeys(["a.weight", "a.bias", "b.weight", "b.bias"], "reference")
