"""The collectives on gloo at world sizes 1..4, against references computed in this process.

Inputs are multiples of 1/4 between -2 and 2, so every sum over up to four
ranks is exact in bf16, fp16 and fp32 and the references can demand equality:
they do the same arithmetic (cast, divide, sum, divide) in the same dtype.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shard_comms as sc
from shard_comms import _collectives, plumbing
from shard_comms._buffers import BufferCache, _bucket

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
WORLD_SIZES = [1, 2, 3, 4]
ALGORITHMS = ["all_reduce", "reduce_scatter"]


def _values(seed: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    quarters = torch.randint(-8, 9, (numel,), generator=generator)
    return (quarters.to(torch.float32) / 4).to(dtype)


def _sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = tensors[0].clone()
    for tensor in tensors[1:]:
        total += tensor
    return total


# ---------------------------------------------------------------------------
# Functions run on every rank
# ---------------------------------------------------------------------------


def _rank_all_gather(numel: int, dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    output = torch.full((numel * world,), 99.0, dtype=out_dtype)
    sc.all_gather(output, _values(rank, numel, dtype))
    return output


def _rank_all_gather_async(numel: int) -> tuple[torch.Tensor, str, str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    output = torch.zeros(numel * world)
    handle = sc.all_gather(output, _values(rank, numel, torch.float32), async_op=True)
    before = repr(handle)
    handle.wait()
    handle.wait()
    return output, before, repr(handle)


def _rank_chunked_all_gather(numel: int, async_op: bool) -> list[torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = _collectives._GATHER_CHUNK_BYTES
    _collectives._GATHER_CHUNK_BYTES = 40
    try:
        output = torch.zeros(numel * world)
        with sc.count_collectives() as counts:
            handle = sc.all_gather(output, _values(rank, numel, torch.float32), async_op=async_op)
            handle.wait()
    finally:
        _collectives._GATHER_CHUNK_BYTES = saved
    return [output, torch.tensor(counts.calls("all_gather"))]


def _rank_reduce_scatter(
    numel: int, dtype: torch.dtype, kwargs: dict[str, Any], out_dtype: torch.dtype | None
) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    output = torch.full((numel,), 99.0, dtype=out_dtype or dtype)
    sc.reduce_scatter(output, _values(rank, numel * world, dtype), **kwargs)
    return output


def _rank_reduce_scatter_async(numel: int, algorithm: str) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    output = torch.zeros(numel)
    grad = _values(rank, numel * world, torch.float32)
    handle = sc.reduce_scatter(output, grad, op="avg", algorithm=algorithm, async_op=True)
    handle.wait()
    return output


def _rank_fp16_overflow(pre_divide: float | None) -> torch.Tensor:
    world = dist.get_world_size()
    grad = torch.full((2 * world,), 30000.0, dtype=torch.float16)
    output = torch.empty(2, dtype=torch.float16)
    sc.reduce_scatter(output, grad, op="avg", pre_divide=pre_divide)
    return output


def _rank_all_reduce(
    numel: int, dtype: torch.dtype, kwargs: dict[str, Any], async_op: bool
) -> torch.Tensor:
    rank = dist.get_rank()
    tensor = _values(rank, numel, dtype).view(2, -1)
    sc.all_reduce(tensor, async_op=async_op, **kwargs).wait()
    return tensor


def _rank_broadcast(src: int) -> torch.Tensor:
    tensor = _values(dist.get_rank(), 6, torch.float32)
    sc.broadcast(tensor, src=src)
    return tensor


def _rank_cache_reuse() -> list[int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    output = torch.empty(1000)
    sc.reduce_scatter(
        output, _values(rank, 1000 * world, torch.float32), reduce_dtype=torch.bfloat16
    )
    before = sc.buffer_cache_info()
    for _ in range(3):
        grad = _values(rank, 1000 * world, torch.float32)
        sc.reduce_scatter(output, grad, reduce_dtype=torch.bfloat16)
    after = sc.buffer_cache_info()
    return [after.hits - before.hits, after.misses - before.misses]


def _rank_errors() -> list[str]:
    world = dist.get_world_size()
    messages = []
    attempts = [
        lambda: sc.all_gather(torch.empty(3), torch.empty(2)),
        lambda: sc.reduce_scatter(torch.empty(2), torch.empty(2 * world + 1)),
        lambda: sc.reduce_scatter(torch.empty(2), torch.empty(2 * world), algorithm="ring"),
        lambda: sc.reduce_scatter(torch.empty(4, 2).t(), torch.empty(8 * world)),
        lambda: sc.broadcast(torch.empty(2), src=world),
    ]
    for attempt in attempts:
        try:
            attempt()
        except sc.CommError as exc:
            messages.append(str(exc))
        else:
            messages.append("no error")
    return messages


# ---------------------------------------------------------------------------
# All-gather
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather_concatenates_shards_in_rank_order(
    rank_pool: Any, world_size: int, dtype: torch.dtype
) -> None:
    """Every rank ends with the rank-ordered concatenation of all shards, bit for bit."""
    results = rank_pool.run(_rank_all_gather, world_size, 5, dtype, dtype)
    expected = torch.cat([_values(r, 5, dtype) for r in range(world_size)])
    for result in results:
        assert torch.equal(result, expected)


def test_all_gather_casts_the_shard_to_the_output_dtype(rank_pool: Any) -> None:
    """An fp32 shard gathered into a bf16 output arrives cast to bf16."""
    results = rank_pool.run(_rank_all_gather, 2, 7, torch.float32, torch.bfloat16)
    expected = torch.cat([_values(r, 7, torch.float32) for r in range(2)]).to(torch.bfloat16)
    assert all(torch.equal(result, expected) for result in results)


@pytest.mark.parametrize("world_size", [1, 3])
def test_all_gather_of_empty_shards_is_empty(rank_pool: Any, world_size: int) -> None:
    """Gathering zero-element shards works and yields an empty output."""
    results = rank_pool.run(_rank_all_gather, world_size, 0, torch.float32, torch.float32)
    assert [result.shape for result in results] == [torch.Size([0])] * world_size


def test_all_gather_async_handle_fills_output_on_wait(rank_pool: Any) -> None:
    """The async form returns a pending handle; after wait() (twice is fine) the output is full."""
    results = rank_pool.run(_rank_all_gather_async, 2, 4)
    expected = torch.cat([_values(r, 4, torch.float32) for r in range(2)])
    for output, before, after in results:
        assert torch.equal(output, expected)
        assert before == "CommHandle(pending)"
        assert after == "CommHandle(done)"


@pytest.mark.parametrize("async_op", [False, True])
def test_large_cpu_all_gathers_run_in_chunks_with_the_same_result(
    rank_pool: Any, async_op: bool
) -> None:
    """Above the chunk size (40 bytes here) gathers run in pieces, land the same, count once."""
    results = rank_pool.run(_rank_chunked_all_gather, 3, 7, async_op)
    expected = torch.cat([_values(r, 7, torch.float32) for r in range(3)])
    for output, calls in results:
        assert torch.equal(output, expected)
        assert int(calls) == 1


# ---------------------------------------------------------------------------
# Reduce-scatter
# ---------------------------------------------------------------------------


def _reference_reduce_scatter(
    world: int,
    numel: int,
    dtype: torch.dtype,
    pre: float,
    post: float,
    reduce_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    rdt = reduce_dtype or dtype
    grads = [_values(r, numel * world, dtype).to(rdt) / pre for r in range(world)]
    reduced = _sum(grads) / post
    return [reduced[r * numel : (r + 1) * numel].to(out_dtype or dtype) for r in range(world)]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_reduce_scatter_sum_leaves_each_rank_its_slice(
    rank_pool: Any, world_size: int, dtype: torch.dtype, algorithm: str
) -> None:
    """op='sum' leaves rank r exactly slice r of the elementwise sum, with either algorithm."""
    kwargs = {"op": "sum", "algorithm": algorithm}
    results = rank_pool.run(_rank_reduce_scatter, world_size, 6, dtype, kwargs, None)
    expected = _reference_reduce_scatter(world_size, 6, dtype, 1.0, 1.0)
    for result, reference in zip(results, expected, strict=True):
        assert torch.equal(result, reference)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter_avg_applies_divide_factors(
    rank_pool: Any, world_size: int, dtype: torch.dtype
) -> None:
    """op='avg' divides by the default pre factor before and the post factor after the sum."""
    pre, post = plumbing.divide_factors(world_size)
    results = rank_pool.run(_rank_reduce_scatter, world_size, 6, dtype, {"op": "avg"}, None)
    expected = _reference_reduce_scatter(world_size, 6, dtype, pre, post)
    for result, reference in zip(results, expected, strict=True):
        assert torch.equal(result, reference)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_reduce_scatter_reduces_in_the_reduce_dtype(rank_pool: Any, algorithm: str) -> None:
    """An fp32 gradient reduced in bf16 into an fp32 output equals the bf16 arithmetic, cast up."""
    kwargs = {"op": "sum", "reduce_dtype": torch.bfloat16, "algorithm": algorithm}
    kwargs |= {"pre_divide": 2.0, "post_divide": 3.0}
    results = rank_pool.run(_rank_reduce_scatter, 3, 5, torch.float32, kwargs, torch.float32)
    expected = _reference_reduce_scatter(
        3, 5, torch.float32, 2.0, 3.0, reduce_dtype=torch.bfloat16, out_dtype=torch.float32
    )
    for result, reference in zip(results, expected, strict=True):
        assert result.dtype == torch.float32
        assert torch.equal(result, reference)


def test_reduce_scatter_into_lower_precision_output(rank_pool: Any) -> None:
    """An fp32 reduction can land in a bf16 output: reduced in fp32, then rounded."""
    kwargs = {"op": "avg", "algorithm": "reduce_scatter"}
    results = rank_pool.run(_rank_reduce_scatter, 4, 3, torch.float32, kwargs, torch.bfloat16)
    expected = _reference_reduce_scatter(4, 3, torch.float32, 2.0, 2.0, out_dtype=torch.bfloat16)
    assert all(torch.equal(r, e) for r, e in zip(results, expected, strict=True))


def test_pre_divide_keeps_fp16_average_finite(rank_pool: Any) -> None:
    """Averaging 30000 over 4 ranks in fp16 overflows without a pre-divide, not with the default."""
    with_default = rank_pool.run(_rank_fp16_overflow, 4, None)
    only_post = rank_pool.run(_rank_fp16_overflow, 4, 1.0)
    assert all(torch.equal(r, torch.full((2,), 30000.0, dtype=torch.float16)) for r in with_default)
    assert all(bool(torch.isinf(r).all()) for r in only_post)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_reduce_scatter_async_handle(rank_pool: Any, algorithm: str) -> None:
    """The async form finishes the copy-out and post-divide in wait()."""
    results = rank_pool.run(_rank_reduce_scatter_async, 4, 3, algorithm)
    expected = _reference_reduce_scatter(4, 3, torch.float32, 2.0, 2.0)
    assert all(torch.equal(r, e) for r, e in zip(results, expected, strict=True))


@pytest.mark.parametrize("world_size", [1, 2])
def test_reduce_scatter_of_empty_gradient(rank_pool: Any, world_size: int) -> None:
    """A zero-element gradient reduce-scatters into a zero-element output."""
    results = rank_pool.run(_rank_reduce_scatter, world_size, 0, torch.float32, {"op": "avg"}, None)
    assert [r.numel() for r in results] == [0] * world_size


# ---------------------------------------------------------------------------
# All-reduce, broadcast
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_averages_in_place(rank_pool: Any, world_size: int, dtype: torch.dtype) -> None:
    """op='avg' leaves every rank the average, shape kept, with the default factors."""
    pre, post = plumbing.divide_factors(world_size)
    results = rank_pool.run(_rank_all_reduce, world_size, 8, dtype, {"op": "avg"}, False)
    expected = (_sum([_values(r, 8, dtype) / pre for r in range(world_size)]) / post).view(2, 4)
    assert all(torch.equal(result, expected) for result in results)


def test_all_reduce_async_in_reduce_dtype(rank_pool: Any) -> None:
    """An async fp32 all-reduce in bf16 writes the bf16 sum back into the fp32 tensor on wait()."""
    kwargs = {"op": "sum", "reduce_dtype": torch.bfloat16}
    results = rank_pool.run(_rank_all_reduce, 3, 6, torch.float32, kwargs, True)
    bf16 = _sum([_values(r, 6, torch.float32).to(torch.bfloat16) for r in range(3)])
    assert all(torch.equal(result, bf16.to(torch.float32).view(2, 3)) for result in results)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_broadcast_copies_the_source_rank(rank_pool: Any, world_size: int) -> None:
    """After a broadcast from the last rank every rank holds that rank's tensor."""
    results = rank_pool.run(_rank_broadcast, world_size, world_size - 1)
    expected = _values(world_size - 1, 6, torch.float32)
    assert all(torch.equal(result, expected) for result in results)


# ---------------------------------------------------------------------------
# Errors, factors, buffer cache
# ---------------------------------------------------------------------------


def test_collectives_name_the_mismatch_and_the_fix(rank_pool: Any) -> None:
    """Each bad call raises a CommError (a ValueError) naming the sizes seen and what to do."""
    messages = rank_pool.run(_rank_errors, 2)[0]
    assert messages == [
        "all_gather: output has 3 elements but 2 ranks each contributing a shard of 2 need 4; "
        "size the output as world size * shard elements",
        "reduce_scatter: grad has 5 elements but an output of 2 on 2 ranks needs 4; pad the "
        "flat gradient to a multiple of the world size and size the output as its "
        "1/world-size slice",
        "unknown reduce-scatter algorithm 'ring'; use 'auto', 'reduce_scatter' or 'all_reduce'",
        "reduce_scatter: output must be contiguous (it is written in place); pass a "
        "contiguous tensor, e.g. a view of a flat buffer",
        "broadcast: src=2 is not a rank of a group of size 2",
    ]


def test_collective_without_process_group_says_to_initialise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a process group or an explicit group, a collective says to call init_distributed."""
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    message = (
        "all_gather: torch.distributed is not initialised and no group was given; "
        "call shard_comms.init_distributed() first"
    )
    with pytest.raises(sc.DistributedInitError, match=f"^{re.escape(message)}$"):
        sc.all_gather(torch.empty(2), torch.empty(2))


@pytest.mark.parametrize(
    ("world_size", "factors"),
    [(1, (1.0, 1.0)), (2, (2.0, 1.0)), (3, (2.0, 1.5)), (4, (2.0, 2.0)), (6, (4.0, 1.5)),
     (8, (4.0, 2.0)), (16, (4.0, 4.0)), (64, (8.0, 8.0)), (96, (16.0, 6.0)), (2.5, (1.0, 2.5))],
)  # fmt: skip
def test_divide_factors(world_size: float, factors: tuple[float, float]) -> None:
    """PyTorch's split: pre doubles while it divides N and N / pre > pre; pre * post == N."""
    assert plumbing.divide_factors(world_size) == factors


def test_divide_factors_refuses_a_factor_that_is_not_positive() -> None:
    with pytest.raises(sc.CommError, match=r"^the divide factor must be positive, got 0$"):
        plumbing.divide_factors(0)


def test_resolve_divide_factors_completes_and_checks_the_pair() -> None:
    """'avg' completes a lone factor and rejects a pair whose product is not N; 'sum' keeps 1s."""
    assert plumbing.resolve_divide_factors("avg", 8, 4.0, None) == (4.0, 2.0)
    assert plumbing.resolve_divide_factors("avg", 8, None, 8.0) == (1.0, 8.0)
    assert plumbing.resolve_divide_factors("sum", 8, None, None) == (1.0, 1.0)
    assert plumbing.resolve_divide_factors("sum", 8, 2.0, None) == (2.0, 1.0)
    with pytest.raises(
        sc.CommError, match=re.escape("needs pre_divide * post_divide == 8, got 2.0 * 2.0")
    ):
        plumbing.resolve_divide_factors("avg", 8, 2.0, 2.0)
    with pytest.raises(
        sc.CommError, match=re.escape("pre_divide must be a positive number, got 0.0")
    ):
        plumbing.resolve_divide_factors("avg", 8, 0.0, None)
    with pytest.raises(
        sc.CommError, match=re.escape("unknown reduce op 'max'; use 'sum' or 'avg'")
    ):
        plumbing.resolve_divide_factors("max", 8, None, None)


def test_staging_buffers_are_reused_across_calls(rank_pool: Any) -> None:
    """Repeated reduce-scatters with a cast allocate nothing new: every staging lease is a hit."""
    results = rank_pool.run(_rank_cache_reuse, 2)
    assert results == [[3, 0], [3, 0]]


def test_buffer_cache_buckets_leases_and_evicts() -> None:
    """Buffers round up to a power-of-two bucket, are leased once, and the LRU one is evicted."""
    cache = BufferCache(max_bytes=3 * 4096 * 4)
    first = cache.acquire(3000, torch.float32, torch.device("cpu"))
    second = cache.acquire(3000, torch.float32, torch.device("cpu"))
    assert first.numel() == 4096
    assert first.data_ptr() != second.data_ptr()
    cache.release(first)
    assert cache.acquire(2500, torch.float32, torch.device("cpu")) is first
    cache.release(first)
    cache.release(second)
    third = torch.empty(4096)
    cache.release(third)
    fourth = torch.empty(4096)
    cache.release(fourth)
    info = cache.info()
    assert (info.buffers, info.bytes, info.hits, info.misses) == (3, 3 * 4096 * 4, 1, 2)
    assert cache.acquire(4096, torch.float32, torch.device("cpu")) is fourth
    cache.clear()
    assert cache.info() == sc.BufferCacheInfo(0, 0, 3 * 4096 * 4, 0, 0)
    assert [_bucket(n) for n in (0, 1024, 1025, 4096, 4097)] == [1024, 1024, 2048, 4096, 8192]


def test_buffer_cache_skips_buffers_larger_than_its_limit() -> None:
    """A buffer bigger than the cache's limit is dropped on release instead of kept."""
    cache = BufferCache(max_bytes=1024)
    cache.release(torch.empty(1024))
    assert cache.info().buffers == 0


def test_buffer_cache_keeps_only_cpu_buffers() -> None:
    """Off the CPU a lease is an exact-size fresh tensor and is not kept on release."""
    cache = BufferCache(max_bytes=1 << 20)
    buffer = cache.acquire(10, torch.float32, torch.device("meta"))
    assert (buffer.numel(), buffer.device.type) == (10, "meta")
    cache.release(buffer)
    assert cache.info() == sc.BufferCacheInfo(0, 0, 1 << 20, 0, 0)
