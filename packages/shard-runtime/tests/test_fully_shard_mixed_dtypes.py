"""One unit may hold parameters of several dtypes (beyond PyTorch 2.13, which refuses them).

An fp32 LoRA adapter beside a bf16 base in the same ``fully_shard`` unit: the
unit gathers its shards as bytes in one all-gather, and reduces each dtype's
gradients in that dtype, one reduce-scatter per dtype (see [Note: one
all-gather, many dtypes] and [Note: one reduction per gradient dtype] in
``_per_param_layout.py``). Checked bit for bit against one process that
computes each rank's gradients and averages them as the reduction does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shard_comms import count_collectives
from shard_runtime import MixedPrecisionPolicy, fully_shard
from shard_testing import RankPool
from shard_testing.compat import cpu_mesh

_WIDTH = 12  # odd rows per rank on 2 ranks: the byte gather carries padding too
_STEPS = 3


class _Block(nn.Module):
    """``base(x)`` in bf16 plus an fp32 low-rank adapter ``b(a(x))``."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(_WIDTH, _WIDTH - 1).to(torch.bfloat16)
        self.a = nn.Linear(_WIDTH, 3, bias=False)
        self.b = nn.Linear(3, _WIDTH - 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x.to(torch.bfloat16)).float() + self.b(self.a(x))


def _model(freeze_base: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), nn.Linear(_WIDTH - 1, 2))
    nn.init.normal_(model[0].b.weight)  # a zero adapter would hide the adapter's gradient
    if freeze_base:
        model[0].base.requires_grad_(False)
    return model


def _batches(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(4, _WIDTH, generator=generator) for _ in range(_STEPS)]


def _train_sharded(freeze_base: bool, reduce_fp32: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    model = _model(freeze_base)
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32 if reduce_fp32 else None)
    fully_shard(model[0], mesh=cpu_mesh(), mp_policy=policy)
    fully_shard(model, mesh=cpu_mesh(), mp_policy=policy)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    losses: list[float] = []
    with count_collectives() as counts:
        for x in _batches(rank):
            loss = model(x).square().mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
    params = {n: p.full_tensor() for n, p in model.named_parameters()}  # type: ignore[operator]
    return {
        "losses": losses,
        "params": {n: (t.dtype, t.tolist()) for n, t in params.items()},
        "gathers": counts.calls("all_gather"),
        "gather_bytes": counts.bytes("all_gather"),
        "reduces": counts.calls("reduce_scatter"),
        "reduce_bytes": counts.bytes("reduce_scatter"),
    }


def _train_reference(freeze_base: bool, reduce_fp32: bool, world: int) -> dict[str, Any]:
    """One process: each rank's gradient, averaged as the sharded reduction does."""
    model = _model(freeze_base)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(trainable, lr=0.05)
    batches = [_batches(rank) for rank in range(world)]
    losses: list[list[float]] = [[] for _ in range(world)]
    for step in range(_STEPS):
        total: list[torch.Tensor] | None = None
        for rank in range(world):
            loss = model(batches[rank][step]).square().mean()
            grads = torch.autograd.grad(loss, trainable)
            losses[rank].append(loss.item())
            # divided by the world before the sum (shard's divide factors for 2 ranks)
            scaled = [(g.float() if reduce_fp32 else g) / world for g in grads]
            total = scaled if total is None else [t + s for t, s in zip(total, scaled, strict=True)]
        assert total is not None
        for p, g in zip(trainable, total, strict=True):
            p.grad = g.to(p.dtype)
        optim.step()
        optim.zero_grad()
    params = {n: (p.dtype, p.detach().tolist()) for n, p in model.named_parameters()}
    return {"losses": losses, "params": params}


def _numel_bytes(shapes: list[tuple[tuple[int, ...], torch.dtype]], world: int) -> int:
    """Bytes of the unsharded buffers of ``shapes``, each padded to ``world`` equal rows."""
    total = 0
    for shape, dtype in shapes:
        rows = -(-shape[0] // world) * world
        total += rows * int(torch.Size(shape[1:]).numel()) * dtype.itemsize
    return total


def test_fp32_adapter_beside_bf16_base_trains_as_one_process(rank_pool: RankPool) -> None:
    """Both trainable: one byte all-gather per unit, one reduce-scatter per dtype, exact."""
    ours = rank_pool.run(_train_sharded, 2, False, False)
    reference = _train_reference(False, False, 2)
    assert [r["losses"] for r in ours] == reference["losses"]
    assert ours[0]["params"] == reference["params"]
    assert ours[1]["params"] == reference["params"]
    bf16, fp32 = torch.bfloat16, torch.float32
    block = [((11, 12), bf16), ((11,), bf16), ((3, 12), fp32), ((11, 3), fp32)]
    head = [((2, 11), fp32), ((2,), fp32)]
    # forward: block and root gather (the root reshards after forward: not again in backward)
    assert ours[0]["gathers"] == _STEPS * 3
    assert ours[0]["gather_bytes"] == _STEPS * (2 * _numel_bytes(block, 2) + _numel_bytes(head, 2))
    # backward: the block reduces bf16 and fp32 separately, the root once
    assert ours[0]["reduces"] == _STEPS * 3
    assert ours[0]["reduce_bytes"] == _STEPS * (_numel_bytes(block, 2) + _numel_bytes(head, 2))


def test_frozen_bf16_base_with_fp32_adapter_reduces_once(rank_pool: RankPool) -> None:
    """A frozen bf16 base is gathered beside the adapter and never reduced (the LoRA case)."""
    ours = rank_pool.run(_train_sharded, 2, True, False)
    reference = _train_reference(True, False, 2)
    assert [r["losses"] for r in ours] == reference["losses"]
    assert ours[0]["params"] == reference["params"]
    fp32 = torch.float32
    assert ours[0]["reduces"] == _STEPS * 2
    adapter = [((3, 12), fp32), ((11, 3), fp32)]
    head = [((2, 11), fp32), ((2,), fp32)]
    assert ours[0]["reduce_bytes"] == _STEPS * (_numel_bytes(adapter, 2) + _numel_bytes(head, 2))


def test_reduce_dtype_gives_one_reduction_per_unit(rank_pool: RankPool) -> None:
    """MixedPrecisionPolicy(reduce_dtype=float32): one fp32 reduce-scatter for both dtypes."""
    ours = rank_pool.run(_train_sharded, 2, False, True)
    reference = _train_reference(False, True, 2)
    assert [r["losses"] for r in ours] == reference["losses"]
    assert ours[0]["params"] == reference["params"]
    assert ours[0]["reduces"] == _STEPS * 2
    fp32 = torch.float32
    block = [((11, 12), fp32), ((11,), fp32), ((3, 12), fp32), ((11, 3), fp32)]
    head = [((2, 11), fp32), ((2,), fp32)]
    assert ours[0]["reduce_bytes"] == _STEPS * (_numel_bytes(block, 2) + _numel_bytes(head, 2))
