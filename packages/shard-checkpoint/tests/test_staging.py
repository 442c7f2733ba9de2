"""StagingBuffers: the CPU copy an async save writes, in memory kept from one save to the next.

The copy must hold the values at the call (the source changes at once), keep
the state dict's structure and each tensor's DTensor layout and
``requires_grad`` (DCP records them), reuse its memory while the state dict
keeps its shapes, and leave what it does not handle to DCP's stager.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from shard_checkpoint import get_model_state_dict, get_optimizer_state_dict
from shard_checkpoint._staging import StagingBuffers
from shard_runtime import fully_shard
from shard_testing import RankPool
from shard_testing.models import DIM_IN, ToyNet


def test_the_copy_holds_the_values_at_the_call_and_keeps_its_memory() -> None:
    buffers = StagingBuffers(pin_memory=False)
    weight = torch.arange(6.0).reshape(2, 3).t()  # not contiguous: the copy is
    source: dict[str, Any] = {
        "w": weight,
        "step": torch.tensor(3.0),
        "groups": [{"lr": 0.1, "params": [0, 1], "betas": (0.9, 0.99)}],
        "ordered": OrderedDict(b=torch.ones(2)),
    }
    first = buffers.stage(source)
    assert first is not None
    assert torch.equal(first["w"], weight)
    assert first["w"].is_contiguous()
    assert first["w"].untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
    assert first["groups"] == [{"lr": 0.1, "params": [0, 1], "betas": (0.9, 0.99)}]
    assert type(first["groups"][0]["betas"]) is tuple
    assert type(first["ordered"]) is OrderedDict
    assert buffers.nbytes() == (6 + 1 + 2) * 4

    weight.add_(1)
    source["groups"][0]["lr"] = 0.2
    source["groups"][0]["params"].append(2)
    assert torch.equal(first["w"], torch.arange(6.0).reshape(2, 3).t())
    assert first["groups"] == [{"lr": 0.1, "params": [0, 1], "betas": (0.9, 0.99)}]

    second = buffers.stage(source)
    assert second is not None
    assert second["w"] is first["w"]  # the kept memory, with the new values
    assert torch.equal(second["w"], weight)
    assert second["groups"][0]["lr"] == 0.2

    source["w"] = torch.zeros(4, dtype=torch.float64)  # another shape: another buffer
    third = buffers.stage(source)
    assert third is not None
    assert third["w"] is not first["w"]
    assert torch.equal(third["w"], torch.zeros(4, dtype=torch.float64))
    assert buffers.nbytes() == 4 * 8 + (1 + 2) * 4


def test_requires_grad_is_the_sources() -> None:
    buffers = StagingBuffers(pin_memory=False)
    staged = buffers.stage({"p": torch.nn.Parameter(torch.ones(2)), "b": torch.ones(2)})
    assert staged is not None
    assert staged["p"].requires_grad
    assert type(staged["p"]) is torch.Tensor
    assert not staged["b"].requires_grad


def test_other_leaves_are_left_to_dcp() -> None:
    buffers = StagingBuffers(pin_memory=False)
    assert buffers.stage({"w": torch.ones(2), "extra": io.BytesIO(b"abc")}) is None
    assert buffers.nbytes() == 0  # the copy of "w" made before the refusal is not kept
    assert buffers.stage({"w": torch.ones(2)}) is None  # the run's later saves go to DCP too
    assert buffers.nbytes() == 0
    assert StagingBuffers(pin_memory=False).stage({"w": torch.ones(2), "names": {"a"}}) is None


def _staged_sharded_state() -> dict[str, Any]:
    model = ToyNet(blocks=2, seed=0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, DIM_IN)).sum().backward()
    optim.step()
    source = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    staged = StagingBuffers(pin_memory=False).stage(source)
    assert staged is not None
    checked = 0
    for key, value in source["model"].items():
        copy = staged["model"][key]
        assert type(copy) is DTensor, key
        assert copy.placements == value.placements, key
        assert copy.device_mesh == value.device_mesh, key
        assert copy.shape == value.shape, key
        assert copy.requires_grad == value.requires_grad, key
        assert torch.equal(copy.to_local(), value.to_local()), key
        local, source_local = copy.to_local(), value.to_local()
        assert local.untyped_storage().data_ptr() != source_local.untyped_storage().data_ptr()
        checked += 1
    for fqn, state in source["optim"]["state"].items():
        for name, value in state.items():
            copy = staged["optim"]["state"][fqn][name]
            assert type(copy) is type(value), (fqn, name)
            local = copy.to_local() if isinstance(copy, DTensor) else copy
            expected = value.to_local() if isinstance(value, DTensor) else value
            assert torch.equal(local, expected), (fqn, name)
            checked += 1
    assert staged["optim"]["param_groups"] == source["optim"]["param_groups"]
    return {"checked": checked}


def test_dtensors_keep_their_layout(rank_pool: RankPool) -> None:
    """2 ranks, fully_shard model and Adam state: each staged DTensor has the source's mesh,
    placements, shape and local values, in memory of its own."""
    results = rank_pool.run(_staged_sharded_state, 2)
    assert [r["checked"] for r in results] == [results[0]["checked"]] * 2
    assert results[0]["checked"] > 10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_accelerator_tensors_are_copied_to_pinned_cpu_memory() -> None:
    """With an accelerator: pinned CPU copies, copied without blocking and waited for once."""
    buffers = StagingBuffers(pin_memory=True)
    weight = torch.randn(1024, 1024, device="cuda")
    staged = buffers.stage({"w": weight})
    assert staged is not None
    assert staged["w"].device.type == "cpu"
    assert staged["w"].is_pinned()
    assert torch.equal(staged["w"], weight.cpu())
