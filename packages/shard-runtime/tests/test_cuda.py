"""The runtime on a GPU: both front ends train on CUDA exactly like a plain model.

A world of one NCCL rank in the test process: collectives reduce to local
copies, but the engine's CUDA path runs for real: its all-gather and
reduce-scatter streams, the events ordering them, ``record_stream``, bf16
compute on the device.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shard_comms as sc
from shard_comms import plumbing
from shard_runtime import (
    FullyShardedDataParallel,
    MixedPrecisionPolicy,
    ModuleWrapPolicy,
    fully_shard,
)
from shard_runtime._comm import streams_for
from shard_testing.models import ResidualBlock, ToyNet, toy_batches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def nccl_world() -> Iterator[sc.DistributedState]:
    """One world-of-one NCCL group for the module (the runtime caches meshes on it)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    plumbing.clear_device_handle_cache()
    state = sc.init_distributed(timeout=60)
    try:
        yield state
    finally:
        # init_distributed creates or adopts a group afresh after this; nothing else to forget.
        dist.destroy_process_group()


def _train(model: nn.Module, steps: int = 3) -> list[float]:
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = []
    for step in toy_batches(1, steps):
        x, y = (t.cuda() for t in step[0][0])
        loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def test_fully_shard_on_cuda_matches_a_plain_model(nccl_world: sc.DistributedState) -> None:
    """fully_shard on cuda:0 gives the plain model's losses and parameters."""
    plain = ToyNet().cuda()
    sharded = copy.deepcopy(plain)
    for block in sharded.blocks:
        fully_shard(block)
    fully_shard(sharded)
    expected = _train(plain)
    assert _train(sharded) == pytest.approx(expected, rel=1e-5)
    for (name, p), q in zip(sharded.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), msg=name)
    torch.cuda.synchronize()


def test_communication_runs_on_its_own_streams(nccl_world: sc.DistributedState) -> None:
    """The engine's all-gather and reduce-scatter streams are distinct from the compute stream."""
    streams = streams_for(torch.device("cuda", 0))
    current = torch.cuda.current_stream()
    raws = [getattr(s, "raw", s) for s in (streams.all_gather, streams.reduce_scatter)]
    assert all(isinstance(r, torch.cuda.Stream) for r in raws)
    assert raws[0] != current
    assert raws[1] != current
    assert raws[0] != raws[1]


def test_bf16_compute_on_cuda(nccl_world: sc.DistributedState) -> None:
    """param_dtype=bf16 computes in bf16 on the GPU; shards and their gradients stay fp32."""
    model = ToyNet().cuda()
    seen: list[torch.dtype] = []
    model.head.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    _train(model, steps=1)
    assert seen == [torch.bfloat16]
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_wrapper_on_cuda_matches_a_plain_model(nccl_world: sc.DistributedState) -> None:
    """FullyShardedDataParallel with device_id=0 gives the plain model's losses."""
    plain = ToyNet().cuda()
    wrapped = FullyShardedDataParallel(
        copy.deepcopy(plain), auto_wrap_policy=ModuleWrapPolicy({ResidualBlock}), device_id=0
    )
    assert _train(wrapped) == pytest.approx(_train(plain), rel=1e-5)
