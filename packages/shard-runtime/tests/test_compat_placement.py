"""shard_placement_fn and dp_mesh_dims behave as in PyTorch's fully_shard, errors included."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from shard_testing import RankPool
from shard_testing.compat import error_type as _error_type


def _api(impl: str) -> tuple[Any, Any]:
    if impl == "torch":
        from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
    else:
        from shard_runtime import DataParallelMeshDims, fully_shard
    return fully_shard, DataParallelMeshDims


def _weights_on(dim: int) -> Callable[[nn.Parameter], Shard | None]:
    return lambda p: Shard(dim) if p.ndim == 2 else None


def _train_on_dims(impl: str) -> dict[str, Any]:
    """Shard 2-D weights on dim 1 (via Shard(-1) in the root), train, read the state dict."""
    fully_shard, _ = _api(impl)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 6), nn.Linear(6, 3))
    fully_shard(model[0], mesh=mesh, shard_placement_fn=_weights_on(1))
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh, shard_placement_fn=_weights_on(-1))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(dist.get_rank())
    losses, grads = [], {}
    for _ in range(3):
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 3, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        grads = {n: [str(p) for p in v.grad.placements] for n, v in model.named_parameters()}
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    sd = model.state_dict()
    return {
        "losses": losses,
        "state_dict": {
            k: (
                [str(p) for p in v.placements],
                tuple(v.to_local().shape),
                v.full_tensor().tolist(),
            )
            for k, v in sd.items()
        },
        "grads": grads,
    }


def test_shard_placement_fn_trains_like_torch(rank_pool: RankPool) -> None:
    """Shard(1) and Shard(-1) weights: placements, local shapes, values and losses equal torch's."""
    ref = rank_pool.run(_train_on_dims, 2, "torch")
    ours = rank_pool.run(_train_on_dims, 2, "shard")
    assert ours == ref
    sd = ours[0]["state_dict"]
    assert sd["0.weight"][:2] == (["S(1)"], (12, 4))
    assert sd["3.weight"][:2] == (["S(1)"], (3, 3))  # Shard(-1) normalized to dim 1
    assert sd["2.weight"][:2] == (["S(0)"], (3, 12))
    # None from shard_placement_fn: Shard(0), uneven as torch.chunk (3 rows: 2 + 1).
    assert [r["state_dict"]["3.bias"][:2] for r in ours] == [(["S(0)"], (2,)), (["S(0)"], (1,))]


def _errors(impl: str) -> dict[str, str]:
    """Exception types for bad placements and bad meshes / dp_mesh_dims."""
    fully_shard, dims = _api(impl)
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    named = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))

    def shard(placement: object, cols: int = 4, **kwargs: Any) -> Callable[[], object]:
        fn = (lambda p: placement if p.ndim == 2 else None) if placement != "-" else None
        return lambda: fully_shard(
            nn.Linear(cols, 6), mesh=kwargs.pop("mesh", mesh), shard_placement_fn=fn, **kwargs
        )

    return {
        "dim_too_big": _error_type(shard(Shard(2))),
        "dim_too_negative": _error_type(shard(Shard(-3))),
        "uneven_dim1": _error_type(shard(Shard(1), cols=5)),
        "not_shard": _error_type(shard(Replicate())),
        "mesh_3d": _error_type(shard("-", mesh=init_device_mesh("cpu", (world, 1, 1)))),
        "mesh_2d_unnamed": _error_type(shard("-", mesh=init_device_mesh("cpu", (world, 1)))),
        "dims_empty": _error_type(lambda: dims()),
        "dims_unnamed_mesh": _error_type(shard("-", dp_mesh_dims=dims(shard="dp"))),
        "dims_unknown_name": _error_type(shard("-", mesh=named, dp_mesh_dims=dims(shard="x"))),
        "dims_plain_param": _error_type(shard("-", mesh=named, dp_mesh_dims=dims(shard="dp"))),
        "dims_int_reshard": _error_type(
            shard("-", mesh=named, dp_mesh_dims=dims(shard="dp"), reshard_after_forward=2)
        ),
    }


def test_errors_have_torch_types(rank_pool: RankPool) -> None:
    """Invalid dims, non-Shard results, bad meshes and bad dp_mesh_dims raise torch's types."""
    ref = rank_pool.run(_errors, 2, "torch")
    ours = rank_pool.run(_errors, 2, "shard")
    assert ours == ref
    assert ours[0] == {
        "dim_too_big": "AssertionError",
        "dim_too_negative": "AssertionError",
        "uneven_dim1": "NotImplementedError",
        "not_shard": "ValueError",
        "mesh_3d": "ValueError",
        "mesh_2d_unnamed": "AssertionError",
        "dims_empty": "ValueError",
        "dims_unnamed_mesh": "ValueError",
        "dims_unknown_name": "ValueError",
        "dims_plain_param": "ValueError",
        "dims_int_reshard": "NotImplementedError",
    }


def _spmd(
    impl: str, shape: tuple[int, ...], names: tuple[str, ...], shard: Any, replicate: Any
) -> dict[str, Any]:
    """Parameters are DTensors on the whole mesh (replicated on dp, split over tp), sharded by
    fully_shard(dp_mesh_dims=...); two SGD steps on different data per dp rank."""
    fully_shard, dims = _api(impl)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    tp = len(shape) - 1
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8))
    tp_of = {"0.weight": Shard(0), "0.bias": Shard(0), "2.weight": Shard(1), "2.bias": Replicate()}
    for name, param in list(model.named_parameters()):
        module_name, _, attr = name.rpartition(".")
        placement = tp_of[name]
        local = param.detach()
        if isinstance(placement, Shard):
            local = local.chunk(mesh.size(tp), dim=placement.dim)[mesh.get_local_rank(tp)]
            local = local.contiguous()
        value = DTensor.from_local(local, mesh, [Replicate()] * tp + [placement], run_check=False)
        setattr(model.get_submodule(module_name), attr, nn.Parameter(value))
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims(shard=shard, replicate=replicate))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    dp_rank = dist.get_rank() // mesh.size(tp)
    losses, grads = [], {}
    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + dp_rank)
        x = DTensor.from_local(torch.randn(4, 8, generator=g), mesh, [Replicate()] * len(shape))
        loss = model(x).full_tensor().pow(2).mean()
        loss.backward()
        grads = {n: [str(p) for p in v.grad.placements] for n, v in model.named_parameters()}
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "grads": grads,
        "params": {
            n: (
                [str(p) for p in v.placements],
                v.device_mesh.mesh_dim_names,
                tuple(v.to_local().shape),
                v.full_tensor().tolist(),
            )
            for n, v in model.named_parameters()
        },
    }


def test_dp_mesh_dims_trains_like_torch(rank_pool: RankPool) -> None:
    """FSDP, HSDP and a flattened shard axis over a tp-split whole mesh equal torch's; DDP too."""
    cases: list[tuple[tuple[int, ...], tuple[str, ...], Any, Any]] = [
        ((2, 2), ("dp", "tp"), "dp", None),
        ((2, 1, 2), ("rep", "dp", "tp"), "dp", "rep"),
        ((2, 1, 2), ("a", "b", "tp"), ("a", "b"), None),
    ]
    results = []
    for case in cases:
        ref = rank_pool.run(_spmd, 4, "torch", *case)
        ours = rank_pool.run(_spmd, 4, "shard", *case)
        assert ours == ref, case
        results.append(ours)
    fsdp, hsdp, flat = (r[0]["params"]["0.weight"][:3] for r in results)
    assert fsdp == (["_S(0, 2)", "S(0)"], ("dp", "tp"), (3, 8))
    assert hsdp == (["R", "_S(0, 2)", "S(0)"], ("rep", "dp", "tp"), (6, 8))
    assert flat == (["_S(0, 2)", "S(0)"], ("a_b", "tp"), (3, 8))

    # Replicate only (DDP): PyTorch 2.13 refuses it here ("Expected param's DTensor mesh to be
    # the same mesh passed to fully_shard"); ours keeps whole tp shards and averages over dp,
    # which trains exactly like sharding over dp.
    ddp = rank_pool.run(_spmd, 4, "shard", (2, 2), ("dp", "tp"), None, "dp")
    assert ddp[0]["params"]["0.weight"][:3] == (["R", "S(0)"], ("dp", "tp"), (6, 8))
    for mine, sharded in zip(ddp, results[0], strict=True):
        assert mine["losses"] == sharded["losses"]
        assert [v[3] for v in mine["params"].values()] == [v[3] for v in sharded["params"].values()]
