"""A torchtitan-style mixture-of-experts model, for tests of per-parameter meshes.

Each block has an attention stand-in, a top-1 router, a shared expert and routed
experts whose weights are stacked (``[num_experts, dim, hidden]``), as in
torchtitan's ``GroupedExperts``. With expert parallelism (:func:`split_experts`)
the expert weights become DTensors split over the ``ep`` axis, and each block
gathers its expert-parallel group's tokens, runs its own experts on them and sums
the partial outputs back (all-reduces only: the all-gathers and reduce-scatters
a test counts are then FSDP's alone). Sharding is left to the test: the expert
weights over the expert-data-parallel mesh (``ShardPlacementResult``), the rest
over the data-parallel mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

__all__ = [
    "DIM",
    "EXPERTS",
    "GroupedExperts",
    "MoEBlock",
    "MoEModel",
    "build_moe",
    "expert_param_ids",
    "moe_meshes",
    "split_experts",
]

DIM, HIDDEN, EXPERTS = 8, 8, 4


def _gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather over ``group`` as an all-reduce of zero-padded blocks.

    Only FSDP's own collectives are then all-gathers and reduce-scatters, so a
    test counting those counts FSDP's alone.
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
        out: torch.Tensor = x + self.experts(x, top, weight) + self.shared_expert(x)
        return out


class MoEModel(nn.Module):
    """An input projection, two :class:`MoEBlock` s and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList([MoEBlock() for _ in range(2)])
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        out: torch.Tensor = self.head(x)
        return out

    def blocks(self) -> list[MoEBlock]:
        """The blocks, typed."""
        return [cast(MoEBlock, block) for block in self.layers]


def moe_meshes(ep: int) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
    """``(dp, edp, ep)`` meshes of the world: dp over all ranks, ``edp x ep == dp``."""
    world = init_device_mesh(
        "cpu", (dist.get_world_size() // ep, ep), mesh_dim_names=("efsdp", "ep")
    )
    return world._flatten("dp"), world["efsdp"], world["ep"]


def split_experts(model: MoEModel, ep_mesh: DeviceMesh) -> None:
    """Expert parallelism: each expert weight becomes a DTensor split on dim 0 over ``ep_mesh``.

    Every rank must hold the same full weights (a seeded model).
    """
    for block in model.blocks():
        experts = block.experts
        experts.ep_group = ep_mesh.get_group()
        for name, param in list(experts.named_parameters()):
            sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)])
            setattr(experts, name, nn.Parameter(sharded))


def expert_param_ids(model: MoEModel) -> set[int]:
    """``id`` of every expert weight, for a ``shard_placement_fn``."""
    return {id(p) for block in model.blocks() for p in block.experts.parameters()}


def build_moe(
    shard_with: Callable[..., Any],
    result_types: tuple[type, type] | None,
    ep: int,
    *,
    seed: int = 0,
) -> MoEModel:
    """The model, sharded as torchtitan's ``apply_fsdp`` does: blocks, then the root.

    At ``ep > 1`` the expert weights are split over ``ep`` and shard over the
    expert-data-parallel mesh: ``shard_placement_fn`` returns
    ``result_types[0](Shard(0), result_types[1](mesh=edp, shard_mesh_dim=0))`` for
    them (``ShardPlacementResult`` and ``FSDPMeshInfo``, shard's or PyTorch's; one
    mesh-info object for all). At ``ep == 1`` every weight shards over dp.
    ``shard_with``: ``fully_shard``, shard's or PyTorch's.
    """
    torch.manual_seed(seed)
    model = MoEModel()
    dp_mesh, edp_mesh, ep_mesh = moe_meshes(ep)
    placement_fn = None
    if ep > 1:
        assert result_types is not None
        result_cls, info_cls = result_types
        edp_info = info_cls(mesh=edp_mesh, shard_mesh_dim=0)
        split_experts(model, ep_mesh)
        experts = expert_param_ids(model)

        def placement_fn(param: nn.Parameter) -> Any:
            return result_cls(Shard(0), edp_info) if id(param) in experts else None

    for block in model.blocks():
        shard_with(block, mesh=dp_mesh, shard_placement_fn=placement_fn)
    shard_with(model, mesh=dp_mesh)
    return model
