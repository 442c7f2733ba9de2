"""Per-parameter meshes (``ShardPlacementResult``) beside PyTorch's, on a torchtitan-style MoE.

4 ranks, expert parallelism 2: the world mesh is ``(efsdp=2, ep=2)``; attention,
router and shared expert shard over the data-parallel mesh of all 4 ranks, the
stacked expert weights (DTensors split over ``ep``) over the expert-data-parallel
mesh ``efsdp`` of 2, through ``shard_placement_fn`` returning a
``ShardPlacementResult``. The same script runs with PyTorch's ``fully_shard``, with
shard's (and shard's own result objects) and with shard's given PyTorch's objects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_common as torch_common
from torch.distributed.tensor import DTensor

from shard_comms import count_collectives
from shard_runtime import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult, fully_shard
from shard_testing import RankPool
from shard_testing.compat import error, torch_fsdp_collectives
from shard_testing.moe import DIM, build_moe, moe_meshes

TOKENS, STEPS = 4, 2


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(TOKENS, DIM, generator=g), torch.randn(TOKENS, DIM, generator=g)


def _train(impl: str, result_types: tuple[type, type]) -> dict[str, Any]:
    shard_with = torch_fully_shard if impl == "torch" else fully_shard
    model = build_moe(shard_with, result_types, ep=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, collectives = [], []
    for step in range(STEPS):
        x, y = _batch(step)
        with torch_fsdp_collectives() as torch_counts, count_collectives() as shard_counts:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
        if impl == "torch":
            collectives.append(
                (len(torch_counts["all_gather"]), len(torch_counts["reduce_scatter"]))
            )
        else:
            collectives.append(
                (shard_counts.calls("all_gather"), shard_counts.calls("reduce_scatter"))
            )
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    experts = model.layers[0].experts.w1
    assert isinstance(experts, DTensor)
    return {
        "losses": losses,
        "params": {n: p.full_tensor().tolist() for n, p in model.named_parameters()},
        "collectives": collectives,
        "expert_mesh": (experts.device_mesh.mesh.tolist(), tuple(map(str, experts.placements))),
        "groups": len(fully_shard.state(model.layers[0])._fsdp_param_groups)  # type: ignore[attr-defined]
        if impl != "torch"
        else len(model.layers[0]._get_fsdp_state()._fsdp_param_groups),  # type: ignore[operator]
    }


def _side_by_side() -> dict[str, Any]:
    torch_types = (torch_common.ShardPlacementResult, torch_common.FSDPMeshInfo)
    shard_types = (ShardPlacementResult, FSDPMeshInfo)
    return {
        "torch": _train("torch", torch_types),
        "shard": _train("shard", shard_types),
        "shard_given_torch_objects": _train("shard", torch_types),
    }


def test_moe_with_expert_meshes_matches_pytorch(rank_pool: RankPool) -> None:
    """Losses, parameters, expert DTensor meshes and collectives per step are PyTorch's, exactly.

    Each block has two units (dp and edp): 2 blocks x 2 units + the root gather in
    forward, the blocks' 4 again in backward (resharded after forward): 9 all-gathers
    and 5 reduce-scatters per step on every rank.
    """
    for result in rank_pool.run(_side_by_side, 4):
        torch_result = result["torch"]
        assert torch_result["collectives"] == [(9, 5)] * STEPS
        assert torch_result["groups"] == 2
        for name in ("shard", "shard_given_torch_objects"):
            assert result[name] == torch_result, name


def _hsdp(impl: str) -> dict[str, Any]:
    """Biases replicated over 2 groups of 2 (HSDP), weights sharded over all 4 ranks."""
    shard_with = torch_fully_shard if impl == "torch" else fully_shard
    info_cls = torch_common.HSDPMeshInfo if impl == "torch" else HSDPMeshInfo
    result_cls = torch_common.ShardPlacementResult if impl == "torch" else ShardPlacementResult
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    info = info_cls(mesh=hsdp, shard_mesh_dim=1, replicate_mesh_dim=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
    shard_with(
        model,
        mesh=init_device_mesh("cpu", (4,)),
        shard_placement_fn=lambda p: result_cls(None, info) if p.dim() == 1 else None,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    bias = model[0].bias
    assert isinstance(bias, DTensor)
    return {
        "losses": losses,
        "params": [p.full_tensor().tolist() for p in model.parameters()],  # type: ignore[attr-defined]
        "bias": (bias.device_mesh.mesh.tolist(), [str(p) for p in bias.placements]),
    }


def _hsdp_both() -> dict[str, Any]:
    return {"torch": _hsdp("torch"), "shard": _hsdp("shard")}


def test_hsdp_mesh_info_matches_pytorch(rank_pool: RankPool) -> None:
    """Parameters on an HSDPMeshInfo (replicate x shard) beside ones on the 1-D mesh train as
    PyTorch's, their DTensors on the 2-D mesh."""
    for result in rank_pool.run(_hsdp_both, 4):
        assert result["shard"] == result["torch"]
        assert result["shard"]["bias"] == ([[0, 1], [2, 3]], ["R", "S(0)"])


# ---------------------------------------------------------------------- errors


def _errors() -> dict[str, Any]:
    dp_mesh, edp_mesh, _ = moe_meshes(2)
    info = FSDPMeshInfo(mesh=edp_mesh, shard_mesh_dim=0)

    def shard(fn: Callable[[nn.Parameter], Any]) -> None:
        fully_shard(nn.Linear(4, 4), mesh=dp_mesh, shard_placement_fn=fn)

    class _ReplicateOnly:  # what PyTorch's DDPMeshInfo carries: no shard axis
        mesh, shard_mesh_dim, replicate_mesh_dim = edp_mesh, None, 0

    def both(impl: str) -> dict[str, str]:
        """Cases PyTorch refuses too, with the library ``impl``'s classes."""
        shard_with = torch_fully_shard if impl == "torch" else fully_shard
        result_cls, info_cls = (
            (torch_common.ShardPlacementResult, torch_common.FSDPMeshInfo)
            if impl == "torch"
            else (ShardPlacementResult, FSDPMeshInfo)
        )
        edp_info = info_cls(mesh=edp_mesh, shard_mesh_dim=0)

        def run(fn: Callable[[nn.Parameter], Any], hook: bool = False) -> None:
            model = nn.Sequential(nn.Linear(4, 4))
            shard_with(model, mesh=dp_mesh, shard_placement_fn=fn)
            if hook:
                model.set_all_reduce_hook(lambda t: None)  # type: ignore[operator]

        return {
            "two_infos": error(lambda: run(lambda p: result_cls(None, info_cls(edp_mesh, 0)))),
            "info_on_call_mesh": error(
                lambda: run(
                    lambda p: None if p.dim() == 2 else result_cls(None, info_cls(dp_mesh, 0))
                )
            ),
            "hook_for_two_units": error(
                lambda: run(lambda p: result_cls(None, edp_info) if p.dim() == 1 else None, True)
            ),
            "build_without_axis": error(lambda: info_cls(mesh=edp_mesh)),
        }

    return {
        "torch": both("torch"),
        "shard": both("shard"),
        "no_shard_axis": error(
            lambda: shard(lambda p: ShardPlacementResult(None, _ReplicateOnly()))  # type: ignore[arg-type]
        ),
        "no_mesh_info": error(lambda: shard(lambda p: ShardPlacementResult(None, None))),  # type: ignore[arg-type]
        "bad_placement": error(lambda: shard(lambda p: ShardPlacementResult("x", info))),  # type: ignore[arg-type]
    }


def test_bad_placement_results_are_refused_naming_the_parameter(rank_pool: RankPool) -> None:
    """Two mesh infos for one process group (the call's included), a hook for several units and
    a mesh info without a shard axis fail as in PyTorch; shard names the parameter and the fix."""
    (result, *_) = rank_pool.run(_errors, 4)
    torch_errors, shard_errors = result["torch"], result["shard"]
    assert {k: v.split(":")[0] for k, v in shard_errors.items()} == {
        k: v.split(":")[0] for k, v in torch_errors.items()
    }
    assert shard_errors["two_infos"].startswith(
        "ValueError: fully_shard(Sequential): parameter '0.bias' is placed on FSDPMeshInfo "
        "object at 0x"
    )
    assert "must share one mesh info: build it once" in shard_errors["two_infos"]
    assert shard_errors["info_on_call_mesh"].startswith(
        "ValueError: fully_shard(Sequential): parameter '0.bias' is placed on FSDPMeshInfo "
    )
    assert "is on the mesh passed to fully_shard; " in shard_errors["info_on_call_mesh"]
    assert shard_errors["hook_for_two_units"] == (
        "ValueError: set_all_reduce_hook(Sequential): the module's parameters are on 2 meshes "
        "(ShardPlacementResult in shard_placement_fn), one unit each; one custom collective or "
        "hook cannot serve them all (they communicate over different process groups): set it "
        "on a module whose parameters share one mesh"
    )
    assert shard_errors["build_without_axis"].startswith(
        "AssertionError: FSDPMeshInfo: shard_mesh_dim is required, got None"
    )
    where = "ValueError: fully_shard(Linear): shard_placement_fn returned a"
    assert result["no_shard_axis"].startswith(
        f"{where} mesh_info for parameter 'weight' without shard_mesh_dim "
        "(_ReplicateOnly, replicate only)"
    )
    assert result["no_mesh_info"].startswith(
        f"{where} ShardPlacementResult without mesh_info for parameter 'weight'"
    )
    assert result["bad_placement"].startswith(
        "ValueError: fully_shard: shard_placement_fn returned 'x' for parameter 'weight'"
    )
