"""shard-comms on a GPU: init_distributed picks NCCL, and a world of one runs on CUDA tensors.

These tests initialise a world-of-one NCCL group in the test process itself
(no launcher variables, an in-memory store) and destroy it afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import shard_comms as sc
from shard_comms import plumbing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def nccl_world(monkeypatch: pytest.MonkeyPatch) -> Iterator[sc.DistributedState]:
    """A world-of-one process group made by init_distributed, destroyed afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)
    plumbing.clear_device_handle_cache()
    state = sc.init_distributed(timeout=60)
    try:
        yield state
    finally:
        # init_distributed creates or adopts a group afresh after this; nothing else to forget.
        dist.destroy_process_group()
        plumbing.clear_buffer_cache()


def test_init_distributed_picks_nccl_and_the_first_gpu(nccl_world: sc.DistributedState) -> None:
    """With CUDA present the backend is nccl and the device cuda:0 (LOCAL_RANK defaults to 0)."""
    assert nccl_world.backend == "nccl"
    assert nccl_world.device == torch.device("cuda", 0)
    assert dist.get_backend() == "nccl"
    assert sc.get_device_handle().device_type == "cuda"
    assert sc.init_distributed() is nccl_world


def test_mesh_is_built_on_cuda(nccl_world: sc.DistributedState) -> None:
    """The default mesh takes the current handle's device type: cuda."""
    mesh = sc.build_mesh()
    assert mesh.device_type == "cuda"
    assert mesh.mesh.tolist() == [0]


def test_world_of_one_collectives_on_cuda_tensors(nccl_world: sc.DistributedState) -> None:
    """All-gather, reduce-scatter (bf16 reduce) and all-reduce work locally on CUDA, uncounted."""
    device = nccl_world.device
    shard = torch.arange(6, dtype=torch.float32, device=device)
    gathered = torch.empty(6, dtype=torch.bfloat16, device=device)
    grad = torch.arange(4, dtype=torch.float32, device=device) / 4
    output = torch.empty(4, device=device)
    with sc.count_collectives() as counts:
        sc.all_gather(gathered, shard)
        sc.reduce_scatter(output, grad.clone(), op="avg", reduce_dtype=torch.bfloat16)
        handle = sc.all_reduce(grad, op="avg", async_op=True)
        handle.wait()
    assert torch.equal(gathered, shard.to(torch.bfloat16))
    assert torch.equal(output, grad)
    assert counts.calls() == 0


def test_cuda_staging_buffers_are_left_to_the_caching_allocator(
    nccl_world: sc.DistributedState,
) -> None:
    """Gradients reduced in bf16 into fp32 outputs stage on CUDA without the CPU buffer cache."""
    device = nccl_world.device
    grad = torch.full((3,), 2.0, device=device)
    output = torch.empty(3, device=device)
    kwargs = {"op": "sum", "pre_divide": 2.0, "post_divide": 2.0, "reduce_dtype": torch.bfloat16}
    before = sc.buffer_cache_info()
    sc.reduce_scatter(output, grad.clone(), **kwargs)
    sc.reduce_scatter(output, grad.clone(), **kwargs)
    after = sc.buffer_cache_info()
    assert torch.equal(output, torch.full((3,), 0.5, device=device))
    assert (after.hits, after.misses, after.buffers) == (before.hits, before.misses, before.buffers)
