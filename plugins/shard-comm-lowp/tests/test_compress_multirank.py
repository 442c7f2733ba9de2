"""The compression hooks over real gloo ranks with shard_comms' reducer, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shard_comm_lowp import bf16_compress, fp16_compress
from shard_comms import DefaultGradReducer
from shard_testing import RankPool

HOOKS = {"bf16": bf16_compress, "fp16": fp16_compress}
SHARD_NUMEL = 37


def _reduce_on_every_rank(
    hook_name: str, sharded: bool, algorithm: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reduce one rank-seeded gradient with the hook and by hand; returns (hook, by hand, fp32)."""
    hook = HOOKS[hook_name]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(1000 + rank)
    grad = torch.randn(world_size * SHARD_NUMEL, generator=generator) * 3.0
    reducer = DefaultGradReducer(algorithm=algorithm)  # type: ignore[arg-type]
    pre, post = reducer.pre_divide, reducer.post_divide

    given = grad.clone()
    output = torch.full((SHARD_NUMEL,), float("nan")) if sharded else None
    hook(reducer, given, output)
    result = given if output is None else output

    low = grad.to(hook.dtype)
    exact = grad.clone()
    for tensor in (low, exact):
        tensor.div_(pre)
    piece = slice(rank * SHARD_NUMEL, (rank + 1) * SHARD_NUMEL)
    if sharded and algorithm == "reduce_scatter":
        by_hand = torch.empty(SHARD_NUMEL, dtype=hook.dtype)
        dist.reduce_scatter_single(by_hand, low)
    else:
        dist.all_reduce(low)
        by_hand = low[piece].clone() if sharded else low
    by_hand.div_(post)
    dist.all_reduce(exact)
    exact.div_(post)
    return result, by_hand.to(torch.float32), exact[piece] if sharded else exact


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("hook_name", ["bf16", "fp16"])
@pytest.mark.parametrize(
    ("sharded", "algorithm"),
    [(True, "all_reduce"), (True, "reduce_scatter"), (False, "auto")],
    ids=["reduce_scatter_via_all_reduce", "reduce_scatter_native", "all_reduce"],
)
def test_hook_matches_reducing_in_the_low_dtype_directly(
    rank_pool: RankPool, world_size: int, hook_name: str, sharded: bool, algorithm: str
) -> None:
    """On every rank the hook's fp32 result equals the same collective run on the cast tensor.

    It also differs from the fp32 reduction, so the data really travelled in low precision.
    """
    results = rank_pool.run(_reduce_on_every_rank, world_size, hook_name, sharded, algorithm)
    assert len(results) == world_size
    for rank, (result, by_hand, exact) in enumerate(results):
        assert result.dtype == torch.float32, rank
        assert result.shape == by_hand.shape, rank
        assert torch.equal(result, by_hand), rank
        assert not torch.equal(result, exact), rank
        torch.testing.assert_close(result, exact, rtol=2e-2, atol=2e-2)
