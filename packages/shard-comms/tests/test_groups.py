"""The cached meshes and groups of shard_comms.plumbing: one per kind, per world."""

from __future__ import annotations

import re
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shard_comms as sc
from shard_comms import _groups, plumbing

# ---------------------------------------------------------------------------
# Functions run on every rank
# ---------------------------------------------------------------------------


def _ranks(group: Any) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def _rank_meshes() -> dict[str, Any]:
    world = dist.group.WORLD
    assert world is not None
    default = plumbing.default_mesh("cpu")
    replicated = plumbing.replicated_mesh(world, device_type="cpu")
    shard, replicate = sc.mesh_groups(replicated)
    node = plumbing.node_mesh(2, device_type="cpu")
    return {
        "default": default.mesh.tolist(),
        "default_cached": plumbing.default_mesh("cpu") is default,
        "group_cached": plumbing.group_mesh(world, device_type="cpu")
        is plumbing.group_mesh(world, device_type="cpu"),
        "replicated": replicated.mesh.tolist(),
        "replicated_groups": (_ranks(shard), _ranks(replicate)),
        "replicated_cached": plumbing.replicated_mesh(world, device_type="cpu") is replicated,
        "node": node.mesh.tolist(),
        "node_cached": plumbing.node_mesh(2, device_type="cpu") is node,
    }


def _rank_post_forward() -> tuple[list[int], int, int, int, bool]:
    mesh = sc.build_mesh(device_type="cpu")
    found = plumbing.post_forward_group(mesh, 2)
    again = plumbing.post_forward_group(mesh, 2)
    ranks = dist.get_process_group_ranks(found.group)
    return ranks, found.size, found.index, found.rows, again.group is found.group


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


def test_every_kind_of_mesh_is_built_once_per_world(rank_pool: Any) -> None:
    """Default, group, replicated (N, 1) and per-node meshes have the right ranks and are cached."""
    results = rank_pool.run(_rank_meshes, 4)
    for rank, result in enumerate(results):
        assert result["default"] == [0, 1, 2, 3]
        assert result["replicated"] == [[0], [1], [2], [3]]
        assert result["replicated_groups"] == ([rank], [0, 1, 2, 3])
        assert result["node"] == [[0, 1], [2, 3]]
        assert all(result[key] for key in result if key.endswith("_cached"))


def test_post_forward_groups_are_consecutive_ranks_of_the_shard_axis(rank_pool: Any) -> None:
    """size=2 on 4 ranks: groups {0,1} and {2,3}; each rank knows its index and keeps 2 rows."""
    results = rank_pool.run(_rank_post_forward, 4)
    assert results == [
        ([0, 1], 2, 0, 2, True),
        ([0, 1], 2, 1, 2, True),
        ([2, 3], 2, 0, 2, True),
        ([2, 3], 2, 1, 2, True),
    ]


def test_post_forward_size_must_divide_the_shard_axis() -> None:
    """A size that does not divide the shard axis is a MeshError naming both numbers."""
    mesh = SimpleNamespace(mesh=torch.arange(4), size=lambda dim: 4)
    with pytest.raises(sc.MeshError, match="size=3 must be a positive integer dividing the shard"):
        plumbing.post_forward_group(mesh, 3)  # type: ignore[arg-type]


def test_ranks_that_are_threads_of_one_process_each_build_their_own_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Threads with their own default group (PyTorch's threaded harness) never share an entry.

    ``new_group`` is collective: a rank that found another thread's cached
    groups and skipped its own calls would leave the others waiting forever.
    Here the threads run one after another, so any sharing would show as a
    thread making no ``new_group`` call; a new world (after a re-init) builds
    its groups afresh too.
    """
    world_size = 4
    local = threading.local()
    calls: list[tuple[int, tuple[int, ...]]] = []

    class _Group:
        @property
        def WORLD(self) -> object:
            return local.world

    def new_group(ranks: list[int]) -> object:
        calls.append((local.rank, tuple(ranks)))
        return ("group", id(local.world), tuple(ranks))

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "group", _Group())
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "get_rank", lambda: local.rank)
    monkeypatch.setattr(_groups, "_CACHE", {})
    mesh = SimpleNamespace(mesh=torch.arange(world_size), size=lambda dim: world_size)
    found: dict[tuple[int, int], list[Any]] = {}
    worlds = [[object() for _ in range(world_size)] for _ in range(2)]

    def rank_main(round_: int, rank: int) -> None:
        local.rank, local.world = rank, worlds[round_][rank]
        found[round_, rank] = [
            plumbing.post_forward_group(mesh, 2)  # type: ignore[arg-type]
            for _ in range(2)
        ]

    for round_ in range(2):
        for rank in range(world_size):
            thread = threading.Thread(target=rank_main, args=(round_, rank))
            thread.start()
            thread.join(30)
    expected_calls = [(r, ranks) for r in range(world_size) for ranks in ((0, 1), (2, 3))]
    assert calls == expected_calls * 2
    for (round_, rank), (first, second) in found.items():
        mine = (0, 1) if rank < 2 else (2, 3)
        assert first.group == ("group", id(worlds[round_][rank]), mine)
        assert second == first
        assert (first.index, first.rows) == (rank % 2, 2)


def test_groups_need_an_initialised_world(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before init, asking for a mesh says which call is missing."""
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(sc.MeshError, match=re.escape("call shard_comms.init_distributed()")):
        plumbing.default_mesh()
