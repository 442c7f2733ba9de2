"""Parameters sharded on any dim, or on top of tensor parallelism, and the errors that name them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from shard_runtime import DataParallelMeshDims, fully_shard
from shard_testing import RankPool
from shard_testing.compat import error as _error


def _dim1_training(reshard_after_forward: bool | int) -> dict[str, Any]:
    """Weights on Shard(1) across 4 ranks; two steps; the full weight seen in forward."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 5))
    full_weights = [model[0].weight.detach().clone(), model[2].weight.detach().clone()]
    seen: list[bool] = []

    def check(module: nn.Module, _args: object) -> None:
        if not seen:
            seen.append(torch.equal(module.weight, full_weights[0]))

    model[0].register_forward_pre_hook(check)

    def fn(p: nn.Parameter) -> Shard | None:
        return Shard(1) if p.ndim == 2 else None

    for layer in (model[0], model[2]):
        fully_shard(
            layer, mesh=mesh, shard_placement_fn=fn, reshard_after_forward=reshard_after_forward
        )
    fully_shard(model, mesh=mesh)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(2):
        loss = model(torch.randn(3, 8, generator=g)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    weight = model[2].weight
    assert isinstance(weight, DTensor)
    return {
        "losses": losses,
        "seen_full": seen,
        "local": tuple(weight.to_local().shape),
        "placements": [str(p) for p in weight.placements],
    }


def test_dim1_shards_gather_full_and_reshard_to_a_smaller_group(rank_pool: RankPool) -> None:
    """On Shard(1) the forward sees the full weight; resharding to groups of 2 changes no loss."""
    full = rank_pool.run(_dim1_training, 4, True)
    grouped = rank_pool.run(_dim1_training, 4, 2)
    assert [r["losses"] for r in grouped] == [r["losses"] for r in full]
    assert all(r["seen_full"] == [True] for r in full + grouped)
    assert full[0]["local"] == (5, 3)
    assert full[0]["placements"] == ["S(1)"]


def _bad_inputs() -> dict[str, str]:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    mesh2 = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))

    def placed(result: object, cols: int = 4) -> Callable[[], object]:
        model = nn.Sequential(nn.Linear(cols, 6))
        return lambda: fully_shard(
            model, mesh=mesh, shard_placement_fn=lambda p: result if p.ndim == 2 else None
        )

    def dtensor_params(placements: list[Any], on: Any, **kwargs: Any) -> Callable[[], object]:
        model = nn.Sequential(nn.Linear(4, 4))
        weight = DTensor.from_local(model[0].weight.detach(), on, placements, run_check=False)
        model[0].weight = nn.Parameter(weight)
        return lambda: fully_shard(model, mesh=kwargs.pop("mesh", mesh), **kwargs)

    return {
        "dim": _error(placed(Shard(2))),
        "uneven": _error(placed(Shard(1), cols=5)),
        "not_shard": _error(placed(Replicate())),
        "same_mesh": _error(dtensor_params([Replicate()], mesh)),
        "dims_sharded_dp": _error(
            dtensor_params(
                [Shard(0), Replicate()],
                mesh2,
                mesh=mesh2,
                dp_mesh_dims=DataParallelMeshDims(shard="dp"),
            )
        ),
    }


def test_bad_placements_and_meshes_name_the_parameter(rank_pool: RankPool) -> None:
    """Each refusal names the parameter (or option), the value seen and what to do instead."""
    errors = rank_pool.run(_bad_inputs, 4)[0]
    assert errors["dim"] == (
        "AssertionError: fully_shard: shard_placement_fn returned Shard(dim=2) for parameter "
        "'0.weight' of shape (6, 4), but it has 2 dims; return Shard(d) with -2 <= d < 2"
    )
    assert errors["uneven"].startswith(
        "NotImplementedError: fully_shard: parameter '0.weight' is sharded on dim 1, whose size 5 "
        "(shape (6, 5)) does not divide evenly over 4 ranks"
    )
    assert errors["not_shard"].startswith(
        "ValueError: fully_shard: shard_placement_fn returned Replicate() for parameter "
        "'0.weight'; return Shard(dim)"
    )
    assert errors["same_mesh"].startswith(
        "RuntimeError: fully_shard: parameter '0.weight' is a DTensor on DeviceMesh((dp=4)"
    )
    assert "cut both from one mesh" in errors["same_mesh"]
    assert errors["dims_sharded_dp"].startswith(
        "ValueError: fully_shard: parameter '0.weight' is placed (Shard(dim=0), Replicate()); "
        "with dp_mesh_dims it must be Replicate() on the data-parallel axis 'dp'"
    )
