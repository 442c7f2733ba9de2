"""bf16 compute with fp32 gradient reduction follows a plain fp32 model to bf16 precision."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shard_runtime import MixedPrecisionPolicy, fully_shard
from shard_testing import RankPool


def _blocks_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))


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


def _accumulate_without_sync(impl: str, param_dtype: str, reduce_dtype: str) -> list[bytes]:
    """Two micro-batches without gradient sync, then one with; the sharded grads as bytes."""
    from shard_testing.compat import fsdp_namespace

    ns = fsdp_namespace(impl)  # type: ignore[arg-type]
    model = _blocks_model()
    policy = ns.MixedPrecisionPolicy(
        param_dtype=getattr(torch, param_dtype), reduce_dtype=getattr(torch, reduce_dtype)
    )
    ns.fully_shard(model[2], mp_policy=policy)
    ns.fully_shard(model, mp_policy=policy)
    g = torch.Generator().manual_seed(5 + dist.get_rank())
    for micro in range(3):
        model.set_requires_gradient_sync(micro == 2)
        model(torch.randn(4, 4, generator=g)).float().pow(2).mean().backward()
    grads = []
    for p in model.parameters():
        local = p.grad.to_local()  # type: ignore[union-attr]
        grads.append(local.detach().float().numpy().tobytes())
    return grads


@pytest.mark.parametrize(
    ("param_dtype", "reduce_dtype"), [("bfloat16", "float32"), ("float32", "bfloat16")]
)
def test_micro_batches_without_sync_accumulate_in_reduce_dtype(
    rank_pool: RankPool, param_dtype: str, reduce_dtype: str
) -> None:
    """Gradients kept between backwards without sync are summed in the policy's reduce dtype,
    as PyTorch's fully_shard does: the reduced gradients are bitwise PyTorch's."""
    shard = rank_pool.run(_accumulate_without_sync, 2, "shard", param_dtype, reduce_dtype)
    torch_grads = rank_pool.run(_accumulate_without_sync, 2, "torch", param_dtype, reduce_dtype)
    assert shard == torch_grads
