"""Every mesh and process group the runtime derives, built once and cached in one place.

The front ends ask for a mesh per kind of sharding (the world's default mesh,
a mesh over a given group, a hybrid mesh from a group pair or a node size, a
replicated mesh for NO_SHARD) and for the smaller group a unit reshards to
after forward. Creating a process group is collective (every rank must call
``new_group`` in the same order), so each is created once per job and every
later request returns the cached object; :func:`mesh_groups` reads the
(shard, replicate) groups back from a mesh by position.

[Note: one group cache per world]
Every cache key starts with the default group (``dist.group.WORLD``) the
request is made in. Two reasons. A job that destroys its process group and
initialises a new one must not get meshes over the destroyed groups back.
And in PyTorch's threaded test harness the ranks are threads of one process,
each with its own default group: a key without the world would let the second
thread find the first thread's groups and skip the collective ``new_group``
calls the first thread is waiting in, a deadlock. No lock is held while a
group is built, for the same reason: a thread holding it inside a collective
would block the other ranks from ever joining.

[Note: a mesh without a default group]
PyTorch's wrapper accepts an explicit ``process_group`` when no default
process group exists: its own tests pass a stand-in group of one rank, and
fairseq passes one to train a world of one without ``init_process_group``.
A ``DeviceMesh`` normally asks the default group for the rank, so
:func:`standalone_group_mesh` builds a 1-D mesh that takes its rank and its
one axis group from the given group instead. Collectives over a group of one
rank are local copies (``_collectives.py``), so a unit on such a mesh trains
without ever touching ``torch.distributed``; a larger stand-in group fails at
its first collective, as under PyTorch. It is never cached: the cache is
keyed by the default group, which does not exist here.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from shard_comms._mesh import build_mesh
from shard_core.errors import MeshError

__all__ = [
    "PostForwardGroup",
    "clear_group_cache",
    "default_mesh",
    "group_mesh",
    "hybrid_mesh",
    "joined_mesh",
    "mesh_groups",
    "node_mesh",
    "post_forward_group",
    "replicated_mesh",
    "separate_reduce_scatter_group",
    "standalone_group_mesh",
]

_T = TypeVar("_T")

# See [Note: one group cache per world]. Values are DeviceMesh or list[ProcessGroup].
_CACHE: dict[tuple[Hashable, ...], object] = {}


def _world() -> ProcessGroup:
    world = dist.group.WORLD if dist.is_initialized() else None
    if world is None:
        raise MeshError(
            "torch.distributed is not initialised; call shard_comms.init_distributed() "
            "(or torch.distributed.init_process_group) first"
        )
    return world


def _cached(kind: str, key: tuple[Hashable, ...], make: Callable[[], _T]) -> _T:
    """The object cached for ``(kind, world, *key)``, made by ``make()`` the first time."""
    full = (kind, _world(), *key)
    if full not in _CACHE:
        _CACHE[full] = make()
    return _CACHE[full]  # type: ignore[return-value]  # make's type, stored under its kind


def clear_group_cache() -> None:
    """Forget every cached mesh and group (tests; the groups themselves stay alive)."""
    _CACHE.clear()


def default_mesh(device_type: str | None = None) -> DeviceMesh:
    """The 1-D ``("shard",)`` mesh over the whole world, one per world and device type.

    What ``fully_shard`` uses without ``mesh=`` and the wrapper's FULL_SHARD
    without a group. ``device_type=None`` is the current device handle's.
    """
    return _cached("default", (device_type,), lambda: build_mesh(device_type=device_type))


def group_mesh(group: ProcessGroup, *, device_type: str | None = None) -> DeviceMesh:
    """The 1-D mesh over ``group`` (FULL_SHARD, SHARD_GRAD_OP over a given group)."""
    return _cached(
        "group", (group, device_type), lambda: build_mesh(groups=group, device_type=device_type)
    )


def hybrid_mesh(
    shard_group: ProcessGroup, replicate_group: ProcessGroup, *, device_type: str | None = None
) -> DeviceMesh:
    """The 2-D (replicate, shard) mesh over an explicit group pair (HYBRID_SHARD)."""
    return _cached(
        "hybrid",
        (shard_group, replicate_group, device_type),
        lambda: build_mesh(groups=(shard_group, replicate_group), device_type=device_type),
    )


def node_mesh(node_size: int, *, device_type: str | None = None) -> DeviceMesh:
    """The 2-D mesh sharding within nodes of ``node_size`` ranks, replicating across them."""
    return _cached(
        "node",
        (node_size, device_type),
        lambda: build_mesh(node_size=node_size, device_type=device_type),
    )


def replicated_mesh(group: ProcessGroup, *, device_type: str | None = None) -> DeviceMesh:
    """An (N, 1) mesh over ``group``: every rank a replica, shard groups of one (NO_SHARD).

    The engine then "all-gathers" by a local copy and reduces by an all-reduce
    across the N replicas, with no code of its own for NO_SHARD.
    """

    def make() -> DeviceMesh:
        ranks = dist.get_process_group_ranks(group)
        # Collective: every rank creates every group of one, in the same order.
        singles = [dist.new_group([rank]) for rank in ranks]
        mine = singles[ranks.index(dist.get_rank())]
        return build_mesh(groups=(mine, group), device_type=device_type)

    return _cached("replicated", (group, device_type), make)


def joined_mesh(outer: DeviceMesh, inner: DeviceMesh) -> DeviceMesh:
    """The mesh of ``outer``'s axes followed by ``inner``'s; both cut from one parent mesh.

    A tensor-parallel parameter under ``fully_shard`` lives on the data-parallel
    axes joined with its tensor-parallel axes.
    """
    return _cached("joined", (outer, inner), lambda: DeviceMesh._concatenate([outer, inner]))


def separate_reduce_scatter_group(shard_group: ProcessGroup) -> ProcessGroup:
    """A second group over ``shard_group``'s ranks, for reduce-scatters only.

    One per set of ranks per world, created the first time it is asked for;
    only the member ranks take part (``use_local_synchronization``), so on a
    2-D mesh each replica's shard ranks create their own.
    """
    ranks = tuple(dist.get_process_group_ranks(shard_group))

    def make() -> ProcessGroup:
        group: ProcessGroup | None = dist.new_group(
            list(ranks), use_local_synchronization=True, group_desc="shard_reduce_scatter"
        )
        assert group is not None  # every caller is a member
        return group

    return _cached("separate_reduce_scatter", (ranks,), make)


class _StandaloneGroupMesh(DeviceMesh):
    """A 1-D mesh over one group, for when no default group exists; see [Note: a mesh ...]."""

    def __init__(self, group: ProcessGroup, device_type: str) -> None:
        super().__init__(
            device_type,
            list(range(group.size())),
            mesh_dim_names=("shard",),
            _init_backend=False,
            _rank=group.rank(),
        )
        self._group = group

    def get_group(self, mesh_dim: int | str | None = None) -> ProcessGroup:
        return self._group

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        return self._group.rank()


def standalone_group_mesh(group: ProcessGroup, *, device_type: str) -> DeviceMesh:
    """A 1-D mesh over ``group`` that needs no default process group.

    Only for when ``torch.distributed`` is not initialised (see [Note: a mesh
    without a default group]); with a default group use :func:`group_mesh`.
    ``group`` needs only ``rank()`` and ``size()`` until its first collective.
    """
    if dist.is_initialized():
        raise MeshError(
            "standalone_group_mesh: torch.distributed is initialised; use group_mesh(group), "
            "whose mesh the rest of the job shares"
        )
    return _StandaloneGroupMesh(group, device_type)


def mesh_groups(mesh: DeviceMesh) -> tuple[ProcessGroup, ProcessGroup | None]:
    """``(shard_group, replicate_group)`` of a 1-D or 2-D mesh, by position.

    The last axis shards and the first (of two) replicates, whatever their
    names, as in PyTorch; ``replicate_group`` is ``None`` for a 1-D mesh.
    """
    if mesh.ndim == 1:
        return mesh.get_group(0), None
    if mesh.ndim == 2:
        return mesh.get_group(1), mesh.get_group(0)
    raise MeshError(
        f"shard runs on 1-D (shard) or 2-D (replicate, shard) meshes, got a {mesh.ndim}-D mesh "
        f"with axes {mesh.mesh_dim_names}; slice it to the data-parallel axes first"
    )


@dataclass(frozen=True, slots=True)
class PostForwardGroup:
    """The smaller group a unit reshards to after forward (``reshard_after_forward=int``).

    The shard axis of ``world`` ranks is cut into consecutive groups of
    ``size`` ranks; this rank is member ``index`` of its group and keeps
    ``rows = world // size`` of the full all-gather's per-rank blocks, the
    ones at ``[index * rows, (index + 1) * rows)``. Gathering those over the
    group rebuilds exactly the full all-gather's output.

    Attributes:
        group: This rank's post-forward group.
        size: Ranks per post-forward group.
        index: This rank's position in ``group``.
        rows: Per-rank blocks of the full all-gather each member keeps.
    """

    group: ProcessGroup
    size: int
    index: int
    rows: int


def post_forward_group(mesh: DeviceMesh, size: int) -> PostForwardGroup:
    """This rank's group of ``size`` consecutive ranks along ``mesh``'s shard axis.

    ``size`` must divide the shard axis. Every rank of the world must call it
    with the same mesh layout: the groups of every row of the mesh are created
    together (see [Note: one group cache per world]).
    """
    shard_world = mesh.size(-1)
    if not isinstance(size, int) or size < 1 or shard_world % size != 0:
        raise MeshError(
            f"post_forward_group: size={size!r} must be a positive integer dividing the "
            f"shard axis size {shard_world}"
        )
    rows = mesh.mesh.reshape(-1, shard_world).tolist()
    layout = tuple(tuple(row[i : i + size]) for row in rows for i in range(0, shard_world, size))
    groups = _cached(
        "post_forward", (layout,), lambda: [dist.new_group(list(ranks)) for ranks in layout]
    )
    rank = dist.get_rank()
    for ranks, group in zip(layout, groups, strict=True):
        if rank in ranks:
            return PostForwardGroup(
                group=group, size=size, index=ranks.index(rank), rows=shard_world // size
            )
    raise MeshError(f"post_forward_group: rank {rank} is not in the mesh {mesh}")
