"""Per-parameter meshes (``ShardPlacementResult``) beside PyTorch's, on a torchtitan-style MoE.

4 ranks, expert parallelism 2: the world mesh is ``(efsdp=2, ep=2)``; attention,
router and shared expert shard over the data-parallel mesh of all 4 ranks, the
stacked expert weights (DTensors split over ``ep``) over the expert-data-parallel
mesh ``efsdp`` of 2, through ``shard_placement_fn`` returning a
``ShardPlacementResult``. The same script runs with PyTorch's ``fully_shard``, with
shard's (and shard's own result objects) and with shard's given PyTorch's objects.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_common as torch_common
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from shard_comms import count_collectives
from shard_runtime import FSDPMeshInfo, ShardPlacementResult, fully_shard
from shard_testing import RankPool
from shard_testing.compat import error

DIM, HIDDEN, EXPERTS, TOKENS, STEPS = 8, 8, 4, 4, 3


def _gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather over ``group`` as an all-reduce of zero-padded blocks.

    Only FSDP's own collectives are all-gathers and reduce-scatters, so the counts
    compared below are FSDP's alone.
    """
    out = x.new_zeros(group.size(), *x.shape)
    out[dist.get_rank(group)] = x
    dist.all_reduce(out, group=group)
    return out.flatten(0, 1)


class _GatherTokens(torch.autograd.Function):
    """All-gather the tokens of the expert-parallel group (backward: sum, keep own rows)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.group.size())[dist.get_rank(ctx.group)], None


class _SumOwnRows(torch.autograd.Function):
    """Sum the experts' partial outputs over the group, keep this rank's tokens."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total.chunk(group.size())[dist.get_rank(group)].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather(grad, ctx.group), None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class GroupedExperts(nn.Module):
    """Stacked expert weights ``[num_experts, ...]``; under EP each rank holds a slice."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * 0.3)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * 0.3)
        self.w3 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * 0.3)
        self.ep_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor, top: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        group = self.ep_group
        if group is not None:
            x = _GatherTokens.apply(x, group)  # type: ignore[no-untyped-call]
            top, weight = _GatherTokens.apply(top, group), _GatherTokens.apply(weight, group)  # type: ignore[no-untyped-call]
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        first = 0 if group is None else dist.get_rank(group) * w1.shape[0]
        out = torch.zeros_like(x)
        for e in range(w1.shape[0]):
            rows = (top == first + e).nonzero().squeeze(1)
            h = nn.functional.silu(x[rows] @ w1[e]) * (x[rows] @ w3[e])
            out = out.index_add(0, rows, (h @ w2[e]) * weight[rows, None])
        return out if group is None else _SumOwnRows.apply(out, group)  # type: ignore[no-untyped-call]


class MoEBlock(nn.Module):
    """Attention stand-in, router (top-1), shared expert and routed experts."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.shared_expert = nn.Sequential(
            nn.Linear(DIM, HIDDEN), nn.SiLU(), nn.Linear(HIDDEN, DIM)
        )
        self.experts = GroupedExperts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x)
        weight, top = torch.softmax(self.router(x), dim=-1).max(dim=-1)
        return x + self.experts(x, top, weight) + self.shared_expert(x)


class MoEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList([MoEBlock() for _ in range(2)])
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def moe_meshes(ep: int) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
    """``(dp, edp, ep)`` meshes of the world: dp over all ranks, ``edp x ep == dp``."""
    world = init_device_mesh(
        "cpu", (dist.get_world_size() // ep, ep), mesh_dim_names=("efsdp", "ep")
    )
    return world._flatten("dp"), world["efsdp"], world["ep"]


def build_moe(
    shard_with: Callable[..., Any],
    result_types: tuple[type, type] | None,
    ep: int,
    *,
    seed: int = 0,
) -> MoEModel:
    """The model, expert weights split over ep (ep > 1), sharded as torchtitan's apply_fsdp.

    ``result_types``: the ``(ShardPlacementResult, FSDPMeshInfo)`` classes the placement
    function builds (shard's or PyTorch's); ``None`` at ep 1, where experts shard over dp.
    """
    torch.manual_seed(seed)
    model = MoEModel()
    dp_mesh, edp_mesh, ep_mesh = moe_meshes(ep)
    placement_fn = None
    if ep > 1:
        assert result_types is not None
        result_cls, info_cls = result_types
        edp_info = info_cls(mesh=edp_mesh, shard_mesh_dim=0)
        for block in model.layers:
            experts = block.experts
            experts.ep_group = ep_mesh.get_group()
            for name, param in list(experts.named_parameters()):
                sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)])
                setattr(experts, name, nn.Parameter(sharded))
        expert_params = {id(p) for block in model.layers for p in block.experts.parameters()}

        def placement_fn(param: nn.Parameter) -> Any:
            return result_cls(Shard(0), edp_info) if id(param) in expert_params else None

    for block in model.layers:
        shard_with(block, mesh=dp_mesh, shard_placement_fn=placement_fn)
    shard_with(model, mesh=dp_mesh)
    return model


@contextlib.contextmanager
def count_torch_collectives() -> Iterator[dict[str, list[bool]]]:
    """The ``async_op`` of every all-gather / reduce-scatter PyTorch's FSDP issues."""
    seen: dict[str, list[bool]] = {"all_gather": [], "reduce_scatter": []}
    originals = {"all_gather": dist.all_gather_single, "reduce_scatter": dist.reduce_scatter_single}

    def counting(kind: str) -> Callable[..., Any]:
        def call(*args: Any, async_op: bool = False, **kwargs: Any) -> Any:
            seen[kind].append(async_op)
            return originals[kind](*args, async_op=async_op, **kwargs)

        return call

    dist.all_gather_single = counting("all_gather")  # type: ignore[assignment]
    dist.reduce_scatter_single = counting("reduce_scatter")  # type: ignore[assignment]
    try:
        yield seen
    finally:
        dist.all_gather_single = originals["all_gather"]  # type: ignore[assignment]
        dist.reduce_scatter_single = originals["reduce_scatter"]  # type: ignore[assignment]


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
        with count_torch_collectives() as torch_counts, count_collectives() as shard_counts:
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
