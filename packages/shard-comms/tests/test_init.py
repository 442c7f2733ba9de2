"""init_distributed: reading the launch environment, choosing backend and device, idempotence.

The decisions are plain functions tested here without a process group; the
calls into torch.distributed are recorded by a stand-in in this process, and
adopting an existing group is tested on the rank pool.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore, TCPStore

import shard_comms as sc
from shard_comms import _process_group, plumbing
from shard_core import CpuDeviceHandle

LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SHARD_STORE_ENDPOINT",
    "TORCHELASTIC_RESTART_COUNT",
)
TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
}


class _FakeAccelerator:
    """Just enough of a CUDA device handle for the init decisions."""

    device_type = "cuda"
    backend = "nccl"

    def __init__(self, available: bool = True, count: int = 2) -> None:
        self.available = available
        self.count = count
        self.set_devices: list[torch.device] = []

    def is_available(self) -> bool:
        return self.available

    def device_count(self) -> int:
        return self.count

    def set_device(self, device: torch.device) -> None:
        self.set_devices.append(device)


# ---------------------------------------------------------------------------
# parse_launch_env, choose_backend, plan_init
# ---------------------------------------------------------------------------


def test_no_launch_variables_is_a_world_of_one() -> None:
    """With none of the launcher's variables set the process is rank 0 of 1, not launched."""
    assert plumbing.parse_launch_env({}) == plumbing.LaunchEnv(
        rank=0, world_size=1, local_rank=0, master_addr=None, master_port=None, launched=False
    )


def test_torchrun_variables_are_read() -> None:
    """torchrun's variables give rank, world size, local rank and the rendezvous address."""
    assert plumbing.parse_launch_env(TORCHRUN) == plumbing.LaunchEnv(
        rank=3, world_size=8, local_rank=1, master_addr="node0", master_port=29500, launched=True
    )


def test_an_outside_store_and_the_restart_count_are_read() -> None:
    """SHARD_STORE_ENDPOINT (the launcher's store) and the elastic agent's restart count."""
    environ = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "SHARD_STORE_ENDPOINT": "127.0.0.1:29400",
        "TORCHELASTIC_RESTART_COUNT": "2",
    }
    assert plumbing.parse_launch_env(environ) == plumbing.LaunchEnv(
        rank=1,
        world_size=2,
        local_rank=1,
        master_addr=None,
        master_port=None,
        launched=True,
        store=("127.0.0.1", 29400),
        attempt=2,
    )


@pytest.mark.parametrize("endpoint", ["127.0.0.1", "host:port", ":29400", "host:70000"])
def test_a_malformed_store_endpoint_is_named(endpoint: str) -> None:
    """An endpoint that is not HOST:PORT says what it should be, and how to do without it."""
    environ = {"RANK": "0", "WORLD_SIZE": "2", "SHARD_STORE_ENDPOINT": endpoint}
    with pytest.raises(sc.DistributedInitError) as error:
        plumbing.parse_launch_env(environ)
    assert str(error.value) == (
        f"SHARD_STORE_ENDPOINT={endpoint!r} is not HOST:PORT of a c10d TCPStore (e.g. "
        "127.0.0.1:29400); set it to the store's address, or unset it to rendezvous through "
        "MASTER_ADDR and MASTER_PORT"
    )


def test_plan_through_an_outside_store() -> None:
    """With the launcher's store, no MASTER_ADDR is needed and no env:// is used."""
    environ = {"RANK": "1", "WORLD_SIZE": "2", "SHARD_STORE_ENDPOINT": "[::1]:29400"}
    plan = plumbing.plan_init(plumbing.parse_launch_env(environ), CpuDeviceHandle())
    assert (plan.init_method, plan.store, plan.attempt) == (None, ("::1", 29400), 0)


@pytest.mark.parametrize(
    ("environ", "local_rank"),
    [
        ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, 1),
        ({"RANK": "5", "WORLD_SIZE": "8"}, 5),
    ],
)
def test_local_rank_defaults(environ: dict[str, str], local_rank: int) -> None:
    """Without LOCAL_RANK the local rank is RANK modulo LOCAL_WORLD_SIZE, else RANK itself."""
    assert plumbing.parse_launch_env(environ).local_rank == local_rank


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not; set both (torchrun does)"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not; set both (torchrun does)"),
        (
            {"RANK": "0", "WORLD_SIZE": "two"},
            "environment variable WORLD_SIZE='two' is not an integer",
        ),
        (
            {"RANK": "4", "WORLD_SIZE": "4"},
            "RANK=4 is outside a world of WORLD_SIZE=4; ranks run 0..3",
        ),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be at least 1"),
    ],
)
def test_malformed_launch_variables_are_named(environ: dict[str, str], message: str) -> None:
    """A partial or malformed environment raises DistributedInitError naming the variable."""
    with pytest.raises(sc.DistributedInitError, match=re.escape(message)):
        plumbing.parse_launch_env(environ)


def test_backend_follows_the_device_handle() -> None:
    """CPU picks gloo, a usable accelerator its own backend, an unusable one gloo."""
    assert plumbing.choose_backend(CpuDeviceHandle()) == "gloo"
    assert plumbing.choose_backend(_FakeAccelerator()) == "nccl"  # type: ignore[arg-type]
    assert plumbing.choose_backend(_FakeAccelerator(available=False)) == "gloo"  # type: ignore[arg-type]


def test_plan_for_a_single_cpu_process() -> None:
    """A world of one on CPU: gloo, in-memory store (no init method), torch's default timeout."""
    plan = plumbing.plan_init(plumbing.parse_launch_env({}), CpuDeviceHandle())
    assert plan == plumbing.InitPlan(
        backend="gloo",
        rank=0,
        world_size=1,
        local_rank=0,
        device=torch.device("cpu"),
        timeout=None,
        init_method=None,
    )


def test_plan_for_torchrun_on_gpus() -> None:
    """Under torchrun with GPUs: nccl, the LOCAL_RANK-th GPU, env:// and the timeout given."""
    launch = plumbing.parse_launch_env(TORCHRUN)
    plan = plumbing.plan_init(launch, _FakeAccelerator(), timeout=30)  # type: ignore[arg-type]
    assert plan == plumbing.InitPlan(
        backend="nccl",
        rank=3,
        world_size=8,
        local_rank=1,
        device=torch.device("cuda", 1),
        timeout=timedelta(seconds=30),
        init_method="env://",
    )
    forced = plumbing.plan_init(launch, _FakeAccelerator(), backend="gloo")  # type: ignore[arg-type]
    assert forced.backend == "gloo"


@pytest.mark.parametrize(
    ("environ", "handle", "timeout", "message"),
    [
        (
            TORCHRUN,
            _FakeAccelerator(count=1),
            None,
            "LOCAL_RANK=1 but only 1 cuda device(s) are visible; start at most 1 processes "
            "per node",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2"},
            CpuDeviceHandle(),
            None,
            "WORLD_SIZE=2 needs MASTER_ADDR and MASTER_PORT to find the other ranks",
        ),
        ({}, CpuDeviceHandle(), -1.0, "timeout=-1.0 must be positive"),
    ],
)
def test_impossible_plans_are_clear_errors(
    environ: dict[str, str], handle: Any, timeout: float | None, message: str
) -> None:
    """Too few devices, no rendezvous address or a non-positive timeout each say what to fix."""
    with pytest.raises(sc.DistributedInitError, match=re.escape(message)):
        plumbing.plan_init(plumbing.parse_launch_env(environ), handle, timeout=timeout)


# ---------------------------------------------------------------------------
# init_distributed with a stand-in torch.distributed
# ---------------------------------------------------------------------------


@pytest.fixture
def fake_dist(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """Record init_process_group calls instead of making them; forget init_distributed's state."""
    calls: list[tuple[str, dict[str, Any]]] = []
    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(calls))

    def init_process_group(backend: str, **kwargs: Any) -> None:
        calls.append((backend, kwargs))

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(_process_group, "_STATE", None)
    monkeypatch.setattr(_process_group, "_STATE_GROUP", None)
    monkeypatch.setattr(
        _process_group, "get_device_handle", lambda device_type=None: CpuDeviceHandle()
    )
    # Never install a SIGTERM handler in the test process; record the states it was asked for.
    monkeypatch.setattr(
        _process_group,
        "_report_on_sigterm",
        lambda state: calls.append(("sigterm report", {"world_size": state.world_size})),
    )
    return calls


def test_init_without_environment_is_a_world_of_one(
    fake_dist: list[tuple[str, dict[str, Any]]],
) -> None:
    """No env vars: one gloo process over an in-memory store, with the timeout passed through."""
    state = sc.init_distributed(timeout=30)
    assert state == sc.DistributedState(
        backend="gloo",
        rank=0,
        world_size=1,
        local_rank=0,
        device=torch.device("cpu"),
        timeout=timedelta(seconds=30),
        adopted=False,
    )
    ((backend, kwargs), report) = fake_dist
    assert report == ("sigterm report", {"world_size": 1})
    assert backend == "gloo"
    assert isinstance(kwargs.pop("store"), HashStore)
    assert kwargs == {
        "rank": 0,
        "world_size": 1,
        "timeout": timedelta(seconds=30),
        "device_id": None,
    }


def test_second_init_returns_the_same_state(fake_dist: list[tuple[str, dict[str, Any]]]) -> None:
    """A second call, with or without the same arguments, returns the first state; no new init."""
    first = sc.init_distributed(timeout=30)
    assert sc.init_distributed() is first
    assert sc.init_distributed(backend="gloo", timeout=timedelta(seconds=30)) is first
    assert len(fake_dist) == 2  # init_process_group, and the SIGTERM report


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"backend": "nccl"},
            "init_distributed(backend='nccl') but torch.distributed is already initialised "
            "with backend 'gloo' (rank 0 of 1); drop the argument, or call "
            "torch.distributed.destroy_process_group() first",
        ),
        (
            {"timeout": 60},
            "init_distributed(timeout=0:01:00) but the process group was created with "
            "timeout=0:00:30 (None: torch's default) (rank 0 of 1)",
        ),
        (
            {"device_type": "cuda"},
            "init_distributed(device_type='cuda') but this process already computes on cpu",
        ),
    ],
)
def test_conflicting_second_init_is_an_error(
    fake_dist: list[tuple[str, dict[str, Any]]], kwargs: dict[str, Any], message: str
) -> None:
    """A second call that contradicts the existing group says what differs and how to fix it."""
    sc.init_distributed(timeout=30)
    with pytest.raises(sc.DistributedInitError, match=re.escape(message)):
        sc.init_distributed(**kwargs)


def test_init_under_torchrun_with_gpus_uses_nccl_and_the_local_gpu(
    fake_dist: list[tuple[str, dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torchrun with a usable accelerator: nccl over env://, current device = LOCAL_RANK."""
    handle = _FakeAccelerator()
    monkeypatch.setattr(_process_group, "get_device_handle", lambda device_type=None: handle)
    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)
    state = sc.init_distributed()
    assert (state.backend, state.rank, state.world_size, state.device) == (
        "nccl",
        3,
        8,
        torch.device("cuda", 1),
    )
    assert handle.set_devices == [torch.device("cuda", 1)]
    assert fake_dist[1:] == [("sigterm report", {"world_size": 8})]
    assert fake_dist[:1] == [
        (
            "nccl",
            {
                "init_method": "env://",
                "rank": 3,
                "world_size": 8,
                "timeout": None,
                "device_id": torch.device("cuda", 1),
            },
        )
    ]


def test_init_through_an_outside_store_uses_one_prefix_per_attempt(
    fake_dist: list[tuple[str, dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks' keys land in the launcher's store under shard/attempt/<restart count>/."""
    outside = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    environ = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "SHARD_STORE_ENDPOINT": f"127.0.0.1:{outside.port}",
        "TORCHELASTIC_RESTART_COUNT": "3",
    }
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    sc.init_distributed(timeout=20)
    (backend, kwargs), report = fake_dist
    assert backend == "gloo"
    assert report == ("sigterm report", {"world_size": 2})
    store = kwargs.pop("store")
    assert kwargs == {
        "rank": 1,
        "world_size": 2,
        "timeout": timedelta(seconds=20),
        "device_id": None,
    }
    store.set("gloo/address", "rank 1")
    assert outside.check(["shard/attempt/3/gloo/address"])
    assert outside.get("shard/attempt/3/gloo/address") == b"rank 1"


def test_an_outside_store_that_does_not_answer_is_named(
    fake_dist: list[tuple[str, dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No store at SHARD_STORE_ENDPOINT: the error names it and where it comes from."""
    closed = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = closed.port
    del closed
    for key, value in {"RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SHARD_STORE_ENDPOINT", f"127.0.0.1:{port}")
    with pytest.raises(sc.DistributedInitError) as error:
        sc.init_distributed(timeout=1)
    assert str(error.value).startswith(
        f"cannot reach the c10d store at 127.0.0.1:{port} (SHARD_STORE_ENDPOINT): "
    )
    assert str(error.value).endswith(
        "; start the ranks with the launcher that hosts it (shard train), or unset "
        "SHARD_STORE_ENDPOINT"
    )
    assert fake_dist == []


# ---------------------------------------------------------------------------
# Adopting a group that exists (rank pool)
# ---------------------------------------------------------------------------


def _rank_adopt() -> dict[str, Any]:
    first = sc.init_distributed()
    second = sc.init_distributed(backend="gloo", timeout=5)
    try:
        sc.init_distributed(backend="nccl")
    except sc.DistributedInitError as exc:
        conflict = str(exc)
    else:
        conflict = "no error"
    return {
        "same": first is second,
        "fields": (first.backend, first.rank, first.world_size, first.local_rank, first.adopted),
        "device": str(first.device),
        "conflict": conflict,
    }


@pytest.mark.parametrize("world_size", [1, 3])
def test_init_adopts_an_existing_group(rank_pool: Any, world_size: int) -> None:
    """In an initialised process it adopts the group, stays idempotent and rejects nccl."""
    results = rank_pool.run(_rank_adopt, world_size)
    for rank, result in enumerate(results):
        assert result["same"] is True
        assert result["fields"] == ("gloo", rank, world_size, rank, True)
        assert result["device"] == "cpu"
        assert result["conflict"] == (
            "init_distributed(backend='nccl') but torch.distributed is already initialised "
            f"with backend 'gloo' (rank {rank} of {world_size}); drop the argument, or call "
            "torch.distributed.destroy_process_group() first"
        )


# ---------------------------------------------------------------------------
# A real world of one (rank pool)
# ---------------------------------------------------------------------------


def _rank_init_world_of_one(seconds: float) -> dict[str, Any]:
    """Leave the pool's group, then init_distributed with no launch variables, for real."""
    dist.destroy_process_group()
    for key in LAUNCH_VARS:
        os.environ.pop(key, None)  # the worker restores its environment after the run
    _process_group._STATE = None
    _process_group._STATE_GROUP = None
    state = sc.init_distributed(timeout=seconds)
    again = sc.init_distributed()
    world = dist.group.WORLD
    assert world is not None
    tensor = torch.ones(3)
    dist.all_reduce(tensor)
    result = {
        "state": state,
        "same": again is state,
        "group": (dist.get_backend(), dist.get_rank(), dist.get_world_size()),
        "timeout": world._get_backend(torch.device("cpu")).options._timeout,
        "all_reduce": tensor.tolist(),
    }
    dist.destroy_process_group()
    _process_group._STATE = None
    _process_group._STATE_GROUP = None
    return result


def test_init_without_launch_variables_creates_a_real_world_of_one(rank_pool: Any) -> None:
    """With no launch variables a real gloo group of one comes up with the timeout given."""
    (result,) = rank_pool.run(_rank_init_world_of_one, 1, 17.0)
    assert result["state"] == sc.DistributedState(
        backend="gloo",
        rank=0,
        world_size=1,
        local_rank=0,
        device=torch.device("cpu"),
        timeout=timedelta(seconds=17),
        adopted=False,
    )
    assert result["same"] is True
    assert result["group"] == ("gloo", 0, 1)
    assert result["timeout"] == timedelta(seconds=17)
    assert result["all_reduce"] == [1.0, 1.0, 1.0]
