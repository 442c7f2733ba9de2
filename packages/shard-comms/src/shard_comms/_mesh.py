"""``build_mesh``: the device meshes shard runs on.

A 1-D mesh shards over every rank (FULL_SHARD). A 2-D mesh is hybrid:
parameters are sharded along the ``"shard"`` axis and replicated along the
``"replicate"`` axis (HYBRID_SHARD), which is what a job wants when the shard
axis fits in one node's fast interconnect. Meshes are plain
``torch.distributed.device_mesh.DeviceMesh`` objects, so they work wherever
PyTorch takes one.

Axis order follows PyTorch: the replicate axis comes first, the shard axis
last; ranks are laid out node by node, so with ``node_size`` ranks per node
the shard groups are the nodes and the replicate groups connect the ranks
with the same local rank across nodes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shard_comms._device import get_device_handle
from shard_core.errors import MeshError

__all__ = ["DEFAULT_AXIS_NAMES_1D", "DEFAULT_AXIS_NAMES_2D", "build_mesh"]

DEFAULT_AXIS_NAMES_1D: tuple[str] = ("shard",)
DEFAULT_AXIS_NAMES_2D: tuple[str, str] = ("replicate", "shard")


def _world_size() -> int:
    if not dist.is_initialized():
        raise MeshError(
            "build_mesh: torch.distributed is not initialised; call "
            "shard_comms.init_distributed() (or torch.distributed.init_process_group) first"
        )
    return dist.get_world_size()


def _axis_names(axis_names: tuple[str, ...] | None, ndim: int) -> tuple[str, ...]:
    if axis_names is None:
        return DEFAULT_AXIS_NAMES_1D if ndim == 1 else DEFAULT_AXIS_NAMES_2D
    names = tuple(axis_names)
    if len(names) != ndim or len(set(names)) != ndim or not all(isinstance(n, str) for n in names):
        raise MeshError(
            f"build_mesh: axis_names={names!r} must be {ndim} distinct strings, one per "
            f"axis of the {ndim}-D mesh (default {_axis_names(None, ndim)!r})"
        )
    return names


def _from_shape(shape: tuple[int, ...], names: tuple[str, ...], device_type: str) -> DeviceMesh:
    world = _world_size()
    if not 1 <= len(shape) <= 2 or any(not isinstance(n, int) or n < 1 for n in shape):
        raise MeshError(
            f"build_mesh: shape={shape!r} must be (shard,) or (replicate, shard) with "
            "positive integers"
        )
    product = 1
    for n in shape:
        product *= n
    if product != world:
        raise MeshError(
            f"build_mesh: shape={shape!r} holds {product} ranks but the world has {world}; "
            f"the axis sizes must multiply to the world size"
        )
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def _from_group_pair(
    shard_group: ProcessGroup,
    replicate_group: ProcessGroup,
    names: tuple[str, ...],
    device_type: str,
) -> DeviceMesh:
    world = _world_size()
    shard_size, replicate_size = shard_group.size(), replicate_group.size()
    if shard_size * replicate_size != world:
        raise MeshError(
            f"build_mesh: groups=(shard group of {shard_size}, replicate group of "
            f"{replicate_size}) cover {shard_size * replicate_size} ranks but the world has "
            f"{world}; every rank must sit in one shard group and one replicate group"
        )
    mine = (
        dist.get_rank(),
        dist.get_process_group_ranks(shard_group),
        dist.get_process_group_ranks(replicate_group),
    )
    gathered: list[tuple[int, list[int], list[int]] | None] = [None] * world
    dist.all_gather_object(gathered, mine)
    mesh = torch.full((replicate_size, shard_size), -1, dtype=torch.int)
    for entry in gathered:
        assert entry is not None
        rank, shard_ranks, replicate_ranks = entry
        row, column = replicate_ranks.index(rank), shard_ranks.index(rank)
        if mesh[row, column] != -1:
            raise MeshError(
                f"build_mesh: ranks {int(mesh[row, column])} and {rank} both claim position "
                f"(replicate {row}, shard {column}); pass groups that tile the world as a grid"
            )
        mesh[row, column] = rank
    for rank, shard_ranks, replicate_ranks in (e for e in gathered if e is not None):
        row, column = replicate_ranks.index(rank), shard_ranks.index(rank)
        if mesh[row].tolist() != shard_ranks or mesh[:, column].tolist() != replicate_ranks:
            raise MeshError(
                f"build_mesh: rank {rank}'s shard group {shard_ranks} and replicate group "
                f"{replicate_ranks} are not a row and a column of one grid "
                f"({mesh.tolist()}); pass (shard_group, replicate_group) built node by node"
            )
    return DeviceMesh.from_group(
        [replicate_group, shard_group], device_type, mesh=mesh, mesh_dim_names=names
    )


def build_mesh(
    shape: int | tuple[int, ...] | None = None,
    *,
    groups: ProcessGroup | tuple[ProcessGroup, ProcessGroup] | None = None,
    node_size: int | None = None,
    axis_names: tuple[str, ...] | None = None,
    device_type: str | None = None,
) -> DeviceMesh:
    """A 1-D data-parallel mesh, or a 2-D (replicate, shard) hybrid mesh.

    Give at most one of:

    - nothing: a 1-D mesh over the default group, axis ``("shard",)``;
    - ``shape``: ``(shard,)`` or ``(replicate, shard)``, multiplying to the world size;
    - ``node_size``: ranks per node; a 2-D mesh sharding within a node and
      replicating across nodes (the world size must be a multiple of it);
    - ``groups``: an existing process group (1-D), or a ``(shard_group,
      replicate_group)`` pair (2-D; every rank must call this).

    Args:
        axis_names: Names of the axes; default ``("shard",)`` or
            ``("replicate", "shard")``.
        device_type: Device type of the mesh; ``None`` is that of the current
            device handle (see :func:`get_device_handle`).

    All ranks must call it together: building a mesh creates process groups.
    """
    given = [
        name
        for name, v in (("shape", shape), ("groups", groups), ("node_size", node_size))
        if v is not None
    ]
    if len(given) > 1:
        raise MeshError(
            f"build_mesh: pass at most one of shape, groups and node_size, got {', '.join(given)}"
        )
    kind = get_device_handle().device_type if device_type is None else device_type
    if isinstance(groups, ProcessGroup):
        _world_size()
        names = _axis_names(axis_names, 1)
        return DeviceMesh.from_group(groups, kind, mesh_dim_names=names)
    if groups is not None:
        if not (
            isinstance(groups, tuple)
            and len(groups) == 2
            and all(isinstance(g, ProcessGroup) for g in groups)
        ):
            raise MeshError(
                f"build_mesh: groups={groups!r} must be a ProcessGroup or a "
                "(shard_group, replicate_group) tuple"
            )
        return _from_group_pair(groups[0], groups[1], _axis_names(axis_names, 2), kind)
    if node_size is not None:
        world = _world_size()
        if not isinstance(node_size, int) or node_size < 1:
            raise MeshError(f"build_mesh: node_size={node_size!r} must be a positive integer")
        if world % node_size != 0:
            raise MeshError(
                f"build_mesh: the world size {world} is not a multiple of node_size={node_size}; "
                "ranks are laid out node by node, so every node must run node_size ranks "
                "(pass the number of ranks per node, e.g. LOCAL_WORLD_SIZE)"
            )
        shape = (world // node_size, node_size)
    elif shape is None:
        shape = (_world_size(),)
    elif isinstance(shape, int):
        shape = (shape,)
    return _from_shape(tuple(shape), _axis_names(axis_names, len(shape)), kind)
