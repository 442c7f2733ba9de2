"""The host-memory knob: freed heap goes back to the OS, after every backward only when asked.

``release_host_memory`` must give back what glibc keeps from frees (a heap
with live blocks between the freed ones, as a training step leaves it, which
glibc's own top-of-heap trimming cannot shrink), and
``set_release_host_memory_after_backward(True)`` must make both front ends
call it once at the end of every backward, changing no value. See
[Note: host memory the allocator keeps] in ``shard_runtime/_host_memory.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import shard_runtime
from shard_runtime import _host_memory
from shard_testing import RankPool
from shard_testing.models import data_parallel_mesh, uneven_mlp

MIB = 2**20
STEPS = 3

needs_malloc_trim = pytest.mark.skipif(
    _host_memory._MALLOC_TRIM is None, reason="the C library has no malloc_trim (not glibc)"
)


@needs_malloc_trim
def test_release_gives_back_a_fragmented_heap() -> None:
    """64 MiB in 32 KiB tensors (below glibc's mmap threshold: all on the heap), every
    eighth kept alive so that the freed ones sit between live blocks: releasing returns
    most of the 56 MiB freed."""
    blocks = [torch.ones(8192) for _ in range(2048)]  # 32 KiB each, every page touched
    kept = blocks[::8]
    del blocks
    released = shard_runtime.release_host_memory()
    assert released > 40 * MIB, released
    assert all(bool((t == 1).all()) for t in kept)


def test_the_switch_takes_a_bool_only() -> None:
    assert _host_memory.releases_after_backward() is False  # off by default
    with pytest.raises(TypeError) as error:
        shard_runtime.set_release_host_memory_after_backward(1)  # type: ignore[arg-type]
    assert str(error.value) == (
        "set_release_host_memory_after_backward(enabled) takes a bool, got int 1"
    )
    assert _host_memory.releases_after_backward() is False


def _local(param: torch.Tensor) -> torch.Tensor:
    local = param.to_local() if isinstance(param, DTensor) else param
    return local.detach().clone()


def _train(front_end: str, release: bool) -> dict[str, Any]:
    """Three steps; how often malloc_trim ran, and the parameters after each step."""
    calls: list[int] = []
    real = _host_memory._MALLOC_TRIM

    def counting(pad: int) -> int:
        calls.append(pad)
        return real(pad) if real is not None else 0

    _host_memory._MALLOC_TRIM = counting
    shard_runtime.set_release_host_memory_after_backward(release)
    try:
        torch.manual_seed(0)
        model: nn.Module = uneven_mlp()
        mesh = data_parallel_mesh()
        if front_end == "fully_shard":
            shard_runtime.fully_shard(model[0], mesh=mesh)
            shard_runtime.fully_shard(model, mesh=mesh)
        else:
            model = shard_runtime.FullyShardedDataParallel(
                model, auto_wrap_policy=shard_runtime.ModuleWrapPolicy({nn.Linear})
            )
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        params: list[list[torch.Tensor]] = []
        per_step: list[int] = []
        for step in range(STEPS):
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
            model(x).square().sum().backward()
            per_step.append(len(calls))
            optim.step()
            optim.zero_grad()
            params.append([_local(p) for p in model.parameters()])
        with torch.no_grad():
            model(x)  # an evaluation forward: no backward, no release
        return {"calls": per_step, "after_eval": len(calls), "params": params}
    finally:
        shard_runtime.set_release_host_memory_after_backward(False)
        _host_memory._MALLOC_TRIM = real


@pytest.mark.parametrize("front_end", ["fully_shard", "wrapper"])
def test_released_once_at_the_end_of_every_backward_when_asked(
    rank_pool: RankPool, front_end: str
) -> None:
    """On: malloc_trim(0) once per backward, none for a no_grad forward; off: never. The
    parameters after every step are bitwise those of the run without it."""
    on = rank_pool.run(_train, 2, front_end, True)
    off = rank_pool.run(_train, 2, front_end, False)
    for with_release, without in zip(on, off, strict=True):
        assert with_release["calls"] == [1, 2, 3]
        assert with_release["after_eval"] == 3
        assert without["calls"] == [0, 0, 0]
        assert without["after_eval"] == 0
        for got, want in zip(with_release["params"], without["params"], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
