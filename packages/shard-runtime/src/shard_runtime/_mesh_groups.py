"""Per-parameter meshes: ``ShardPlacementResult`` and the units of one ``fully_shard`` call.

A ``shard_placement_fn`` may return, for a parameter, a
:class:`ShardPlacementResult`: its shard placement *and* a data-parallel mesh
of its own (:class:`FSDPMeshInfo`, or :class:`HSDPMeshInfo` to replicate
too). Mixture-of-experts models need it: with expert parallelism the expert
weights are already split over the expert-parallel axis, so they shard over
the expert-data-parallel mesh (``dp / ep`` ranks), while the rest of the
block shards over the whole data-parallel mesh.

[Note: one unit per process group]
The parameters of one call are grouped by the process groups they
communicate over (shard group, and replicate group for HSDP), in the order
of each group's first parameter, and each group becomes a
:class:`~shard_runtime._unit.Unit` of its own under the call's one
:class:`~shard_runtime._state.UnitState`: its own all-gather and
reduce-scatter over its own mesh, its sharded DTensors on that mesh. The
state drives every unit at once (gathers before forward and backward, frees
after, reduces when the module's backward is done), so hooks, prefetch and
resharding mean what they mean for one unit. As in PyTorch, parameters on
one process group must name one mesh-info object (two would be two
different claims about the same ranks), and the parameters left to the
call's own mesh (``None`` or ``Shard(dim)``) form their group.

PyTorch's own objects (``torch.distributed.fsdp._fully_shard._fsdp_common``)
are accepted as well: they are read by their attributes (``placement``,
``mesh_info.mesh``, ``shard_mesh_dim``, ``replicate_mesh_dim``), so a
framework that builds PyTorch's (torchtitan) runs on shard unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from shard_comms import mesh_groups
from shard_runtime._flat_placement import FlatShard
from shard_runtime._module_tree import OwnedParam

__all__ = [
    "FSDPMeshInfo",
    "HSDPMeshInfo",
    "MeshGroup",
    "PlacementFn",
    "ShardPlacementResult",
    "group_by_mesh",
]


@dataclass(frozen=True, eq=False)
class FSDPMeshInfo:
    """The data-parallel mesh a :class:`ShardPlacementResult` puts a parameter on.

    Build one per mesh and return that same object for every parameter on it
    (compared by identity, as PyTorch does).

    Attributes:
        mesh: the mesh the parameter's all-gather and reduce-scatter run over;
            its sharded DTensor lives on it (joined with the parameter's own
            tensor-/expert-parallel mesh when it is a DTensor).
        shard_mesh_dim: the axis of ``mesh`` the parameter is sharded over.
            Required; ``None`` only keeps PyTorch's signature.
        replicate_mesh_dim: ``None`` for FSDP; use :class:`HSDPMeshInfo` to
            replicate across an axis.
    """

    mesh: DeviceMesh
    shard_mesh_dim: int | None = None
    replicate_mesh_dim: int | None = None

    def __post_init__(self) -> None:
        if self.shard_mesh_dim is None:
            # AssertionError, as PyTorch's FSDPMeshInfo raises here.
            raise AssertionError(
                f"{type(self).__name__}: shard_mesh_dim is required, got None; give the axis "
                "of the mesh to shard over, e.g. FSDPMeshInfo(mesh=edp_mesh, shard_mesh_dim=0)"
            )


@dataclass(frozen=True, eq=False)
class HSDPMeshInfo(FSDPMeshInfo):
    """:class:`FSDPMeshInfo` of a 2-D mesh: replicate over axis 0, shard over axis 1."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.replicate_mesh_dim is None:
            # AssertionError, as PyTorch's HSDPMeshInfo raises here.
            raise AssertionError(
                "HSDPMeshInfo: replicate_mesh_dim is required, got None; give the replicate "
                "axis, e.g. HSDPMeshInfo(mesh=mesh, shard_mesh_dim=1, replicate_mesh_dim=0)"
            )


@dataclass(frozen=True, eq=False)
class ShardPlacementResult:
    """What ``shard_placement_fn`` returns to put a parameter on its own mesh.

    Attributes:
        placement: ``Shard(dim)`` (or ``FlatShard()``) on ``mesh_info``'s shard
            axis; ``None`` means ``Shard(0)``.
        mesh_info: the data-parallel mesh; see :class:`FSDPMeshInfo`.
    """

    placement: Shard | FlatShard | None
    mesh_info: FSDPMeshInfo


# What ``shard_placement_fn`` may return (PyTorch's ShardPlacementResult too, by attributes).
PlacementFn = Callable[[nn.Parameter], Shard | FlatShard | ShardPlacementResult | None]

_GroupKey = tuple[dist.ProcessGroup, dist.ProcessGroup | None]
_NOT_A_RESULT = object()


@dataclass(eq=False)
class MeshGroup:
    """The parameters of one ``fully_shard`` call that become one unit (one process group).

    Attributes:
        mesh: the unit's mesh, 1-D (shard) or 2-D (replicate, shard).
        is_call_mesh: whether ``mesh`` is the mesh passed to ``fully_shard``
            (its ``dp_mesh_dims`` and ``reshard_after_forward`` checks apply).
        params: the group's parameters, in the call's order.
        placements: each parameter's placement as returned (``Shard``,
            ``FlatShard`` or ``None``; checked where it is resolved,
            :func:`~shard_runtime._param.resolve_shard_dim`).
    """

    mesh: DeviceMesh
    is_call_mesh: bool
    params: list[OwnedParam] = field(default_factory=list)
    placements: list[object] = field(default_factory=list)


def group_by_mesh(
    params: list[OwnedParam],
    call_mesh: DeviceMesh,
    shard_placement_fn: PlacementFn | None,
    label: str,
) -> list[MeshGroup]:
    """Split ``params`` into units by process group; see [Note: one unit per process group].

    Always at least one group (the call's mesh, empty when no parameter is on it).

    Raises:
        ValueError: a mesh info without a shard axis, on a mesh shard cannot
            run on, or two mesh infos for one process group.
    """
    call_group = MeshGroup(call_mesh, is_call_mesh=True)
    groups: dict[_GroupKey, tuple[object, MeshGroup]] = {}
    for owned in params:
        result = None if shard_placement_fn is None else shard_placement_fn(owned.param)
        info = getattr(result, "mesh_info", _NOT_A_RESULT)
        claimed: object
        placement: object
        if info is _NOT_A_RESULT:  # None, Shard(dim), FlatShard(): the call's mesh
            mesh, claimed, placement = call_mesh, call_group, result
        else:  # a ShardPlacementResult, shard's or PyTorch's
            mesh = _unit_mesh(owned.fqn, info, label)
            claimed, placement = info, getattr(result, "placement", None)
        key = mesh_groups(mesh)
        if key not in groups:
            group = call_group if claimed is call_group else MeshGroup(mesh, is_call_mesh=False)
            groups[key] = (claimed, group)
        seen = groups[key]
        if seen[0] is not claimed:
            raise ValueError(
                f"fully_shard({label}): parameter {owned.fqn!r} is placed on "
                f"{_describe(claimed)}, but an earlier parameter of this call on the same "
                f"process group is on {_describe(seen[0])}; parameters on one process group "
                "must share one mesh info: build it once and return that object for each, "
                "and return None or Shard(dim) for parameters on the mesh passed to fully_shard"
            )
        seen[1].params.append(owned)
        seen[1].placements.append(placement)
    ordered = [group for _, group in groups.values()]
    return ordered or [call_group]


def _unit_mesh(fqn: str, info: object, label: str) -> DeviceMesh:
    """The 1-D or 2-D (replicate, shard) mesh a mesh info describes, checked."""
    where = f"fully_shard({label}): shard_placement_fn returned a mesh_info for parameter {fqn!r}"
    if info is None:
        raise ValueError(
            f"fully_shard({label}): shard_placement_fn returned a ShardPlacementResult without "
            f"mesh_info for parameter {fqn!r}; give FSDPMeshInfo(mesh=..., shard_mesh_dim=...), "
            "or return Shard(dim) (or None) to shard it on the mesh passed to fully_shard"
        )
    mesh = getattr(info, "mesh", None)
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(
            f"{where} whose mesh is {type(mesh).__name__}, not a DeviceMesh; build it as "
            "FSDPMeshInfo(mesh=<DeviceMesh>, shard_mesh_dim=<axis>)"
        )
    if getattr(info, "dp_mesh_dims", None) is not None:
        raise NotImplementedError(
            f"{where} with dp_mesh_dims; a per-parameter mesh is a data-parallel mesh "
            "itself: give FSDPMeshInfo(mesh=<dp mesh>, shard_mesh_dim=<axis>)"
        )
    shard_dim = getattr(info, "shard_mesh_dim", None)
    replicate_dim = getattr(info, "replicate_mesh_dim", None)
    if shard_dim is None:
        raise ValueError(
            f"{where} without shard_mesh_dim ({type(info).__name__}, replicate only); "
            "fully_shard shards every parameter: give FSDPMeshInfo(mesh=..., "
            "shard_mesh_dim=<axis>), or HSDPMeshInfo to also replicate"
        )
    if not isinstance(shard_dim, int) or not 0 <= shard_dim < mesh.ndim:
        raise ValueError(
            f"{where} with shard_mesh_dim={shard_dim!r}, not an axis of its {mesh.ndim}-D mesh "
            f"{tuple(mesh.shape)}; give 0 <= shard_mesh_dim < {mesh.ndim}"
        )
    if replicate_dim is not None:
        if (mesh.ndim, replicate_dim, shard_dim) != (2, 0, 1) or mesh.mesh_dim_names is None:
            raise ValueError(
                f"{where} replicating over axis {replicate_dim} and sharding over axis "
                f"{shard_dim} of a {mesh.ndim}-D mesh {tuple(mesh.shape)} (axis names "
                f"{mesh.mesh_dim_names}); HSDP needs a 2-D mesh with axis names, replicate "
                "axis 0 and shard axis 1"
            )
        return mesh
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            f"{where} on a {mesh.ndim}-D mesh {tuple(mesh.shape)} without axis names; pass the "
            "1-D mesh of the shard axis (mesh['name']), or name the mesh's axes"
        )
    return mesh[names[shard_dim]]


def _describe(claimed: object) -> str:
    if isinstance(claimed, MeshGroup):
        return "the mesh passed to fully_shard"
    mesh = getattr(claimed, "mesh", None)
    return f"{type(claimed).__name__} object at {id(claimed):#x} (mesh {mesh})"
