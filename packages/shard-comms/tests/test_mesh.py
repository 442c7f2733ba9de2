"""build_mesh: 1-D and 2-D meshes from the world, a shape, a node size or explicit groups."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import shard_comms as sc


def _describe(mesh: DeviceMesh) -> dict[str, Any]:
    shard, replicate = sc.mesh_groups(mesh)
    return {
        "mesh": mesh.mesh.tolist(),
        "names": mesh.mesh_dim_names,
        "device_type": mesh.device_type,
        "shard_ranks": dist.get_process_group_ranks(shard),
        "replicate_ranks": None if replicate is None else dist.get_process_group_ranks(replicate),
    }


# ---------------------------------------------------------------------------
# Functions run on every rank
# ---------------------------------------------------------------------------


def _rank_build(kwargs: dict[str, Any]) -> dict[str, Any]:
    return _describe(sc.build_mesh(**kwargs))


def _rank_build_error(kwargs: dict[str, Any]) -> str:
    try:
        sc.build_mesh(**kwargs)
    except sc.MeshError as exc:
        return str(exc)
    return "no error"


def _grid_groups(world: int, width: int, transposed: bool) -> tuple[Any, Any]:
    """Shard groups are rows of a (world/width, width) grid, replicate groups its columns.

    ``transposed`` builds replicate groups that do not match the rows (an invalid pair).
    """
    rows = [list(range(r * width, (r + 1) * width)) for r in range(world // width)]
    columns = [list(range(c, world, width)) for c in range(width)]
    if transposed:
        columns = [[column[0], column[-1] ^ 1] for column in columns]
    rank = dist.get_rank()
    shard_group = replicate_group = None
    for ranks in rows:
        group = dist.new_group(ranks)
        if rank in ranks:
            shard_group = group
    for ranks in columns:
        group = dist.new_group(ranks)
        if rank in ranks:
            replicate_group = group
    return shard_group, replicate_group


def _rank_from_group_pair() -> dict[str, Any]:
    shard_group, replicate_group = _grid_groups(dist.get_world_size(), 2, transposed=False)
    mesh = sc.build_mesh(groups=(shard_group, replicate_group))
    result = _describe(mesh)
    result["same_groups"] = (
        mesh.get_group("shard") is shard_group and mesh.get_group("replicate") is replicate_group
    )
    return result


def _rank_from_bad_group_pair() -> str:
    shard_group, replicate_group = _grid_groups(dist.get_world_size(), 2, transposed=True)
    try:
        sc.build_mesh(groups=(shard_group, replicate_group))
    except sc.MeshError as exc:
        return str(exc)
    return "no error"


def _rank_from_one_group() -> dict[str, Any]:
    assert dist.group.WORLD is not None
    return _describe(sc.build_mesh(groups=dist.group.WORLD, axis_names=("dp",)))


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_default_mesh_is_one_dimensional_over_the_world(rank_pool: Any, world_size: int) -> None:
    """With no arguments every rank gets a 1-D 'shard' mesh of all ranks on the CPU device type."""
    results = rank_pool.run(_rank_build, world_size, {})
    expected = {
        "mesh": list(range(world_size)),
        "names": ("shard",),
        "device_type": "cpu",
        "shard_ranks": list(range(world_size)),
        "replicate_ranks": None,
    }
    assert results == [expected] * world_size


@pytest.mark.parametrize("kwargs", [{"shape": (2, 2)}, {"node_size": 2}])
def test_hybrid_mesh_shards_within_a_node_and_replicates_across(
    rank_pool: Any, kwargs: dict[str, Any]
) -> None:
    """(2, 2) or node_size=2 on 4 ranks: shard groups {0,1},{2,3}, replicate groups {0,2},{1,3}."""
    results = rank_pool.run(_rank_build, 4, kwargs)
    for rank, result in enumerate(results):
        assert result["mesh"] == [[0, 1], [2, 3]]
        assert result["names"] == ("replicate", "shard")
        assert result["shard_ranks"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert result["replicate_ranks"] == [rank % 2, rank % 2 + 2]


def test_node_size_of_the_whole_world_has_one_replica(rank_pool: Any) -> None:
    """node_size equal to the world size gives a (1, N) mesh: one replica, sharded over all."""
    results = rank_pool.run(_rank_build, 2, {"node_size": 2, "axis_names": ("dp", "fsdp")})
    assert results[1]["mesh"] == [[0, 1]]
    assert results[1]["names"] == ("dp", "fsdp")
    assert results[1]["replicate_ranks"] == [1]


def test_mesh_from_shard_and_replicate_groups(rank_pool: Any) -> None:
    """A (shard_group, replicate_group) pair becomes a 2-D mesh that uses those very groups."""
    results = rank_pool.run(_rank_from_group_pair, 4)
    for rank, result in enumerate(results):
        assert result["mesh"] == [[0, 1], [2, 3]]
        assert result["shard_ranks"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert result["same_groups"] is True


def test_mesh_from_groups_that_do_not_tile_the_world_fails_on_every_rank(rank_pool: Any) -> None:
    """Replicate groups that are not the grid's columns are rejected on every rank, named."""
    results = rank_pool.run(_rank_from_bad_group_pair, 4)
    assert (
        results
        == [
            "build_mesh: rank 0's shard group [0, 1] and replicate group [0, 3] are not a row and "
            "a column of one grid ([[0, 1], [2, 3]]); pass (shard_group, replicate_group) built "
            "node by node"
        ]
        * 4
    )


def test_mesh_from_one_group(rank_pool: Any) -> None:
    """A single process group becomes a 1-D mesh with the axis name given."""
    results = rank_pool.run(_rank_from_one_group, 2)
    assert [r["names"] for r in results] == [("dp",), ("dp",)]
    assert [r["mesh"] for r in results] == [[0, 1], [0, 1]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"node_size": 3},
            "build_mesh: the world size 4 is not a multiple of node_size=3; ranks are laid out "
            "node by node, so every node must run node_size ranks (pass the number of ranks "
            "per node, e.g. LOCAL_WORLD_SIZE)",
        ),
        (
            {"shape": (3, 2)},
            "build_mesh: shape=(3, 2) holds 6 ranks but the world has 4; the axis sizes must "
            "multiply to the world size",
        ),
        (
            {"shape": (1, 2, 2)},
            "build_mesh: shape=(1, 2, 2) must be (shard,) or (replicate, shard) with positive "
            "integers",
        ),
        (
            {"shape": 4, "node_size": 2},
            "build_mesh: pass at most one of shape, groups and node_size, got shape, node_size",
        ),
        (
            {"shape": (2, 2), "axis_names": ("x", "x")},
            "build_mesh: axis_names=('x', 'x') must be 2 distinct strings, one per axis of the "
            "2-D mesh (default ('replicate', 'shard'))",
        ),
        ({"node_size": 0}, "build_mesh: node_size=0 must be a positive integer"),
    ],
)
def test_bad_mesh_requests_are_clear_errors(
    rank_pool: Any, kwargs: dict[str, Any], message: str
) -> None:
    """Each impossible request raises MeshError on every rank, naming the value and the fix."""
    assert rank_pool.run(_rank_build_error, 4, kwargs) == [message] * 4


def test_build_mesh_without_process_group_says_to_initialise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before init, build_mesh says which call is missing."""
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(sc.MeshError, match=re.escape("call shard_comms.init_distributed()")):
        sc.build_mesh()


def test_mesh_groups_rejects_three_axes() -> None:
    """mesh_groups accepts 1-D and 2-D meshes only and says how to get one."""

    class _ThreeD:
        ndim = 3
        mesh_dim_names = ("pp", "dp", "tp")

    with pytest.raises(
        sc.MeshError, match=re.escape("got a 3-D mesh with axes ('pp', 'dp', 'tp')")
    ):
        sc.mesh_groups(_ThreeD())  # type: ignore[arg-type]
