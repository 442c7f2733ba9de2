"""``init_distributed``: the one call a training script makes to join its job.

Under ``torchrun`` (or with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT`` set by hand) it initialises the default
process group over ``env://``; with none of them set it is a world of one
process, initialised over an in-memory store so that no port is opened. The
backend follows the device: the accelerator's (NCCL for CUDA) where a device
handle says an accelerator is usable, gloo otherwise.

The decisions (reading the environment, choosing backend and device) are
plain functions, :func:`parse_launch_env` and :func:`plan_init`, so they are
tested without a process group.

[Note: A store that outlives every rank]
The c10d store is where a failing rank reads its peers' flight records
(``_diagnose.py``), so it must outlive any rank. Under ``env://`` without an
agent's store, rank 0 hosts it, and a dead rank 0 takes it along: the
survivors can only say "no record". ``SHARD_STORE_ENDPOINT=HOST:PORT`` names
a TCPStore hosted outside the ranks instead (``shard train``'s launcher
hosts one, as torchrun's agent does); the ranks rendezvous through it under
the prefix ``shard/attempt/<TORCHELASTIC_RESTART_COUNT>/``, so that the
ranks an elastic agent restarts never read the addresses of the attempt
before (pytorch/pytorch#135712 is that failure for the agent's own store).
The restart count is the same on every rank only when one agent restarts
them all, on one machine: ``shard train`` (``--standalone``) is that case.

In a launched job of several ranks, ``init_distributed`` also installs the
SIGTERM handler of ``_terminate.py`` ([Note: SIGTERM from a launcher]): a
rank its launcher stops says what it knows before it ends.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Not re-exported by torch.distributed on Windows.
from torch._C._distributed_c10d import HashStore, PrefixStore, Store, TCPStore

from shard_comms import _terminate
from shard_comms._device import current_accelerator_type, get_device_handle
from shard_comms._diagnose import termination_report
from shard_core import get_registry
from shard_core.errors import DistributedInitError, UnknownPluginNameError
from shard_core.protocols import DeviceHandle

__all__ = [
    "DistributedState",
    "InitPlan",
    "LaunchEnv",
    "SHARD_DEVICE_ENV",
    "SHARD_STORE_ENV",
    "choose_backend",
    "init_distributed",
    "parse_launch_env",
    "plan_init",
    "resolve_device_handle",
]


SHARD_DEVICE_ENV = "SHARD_DEVICE"
"""Environment variable naming the device type when ``init_distributed`` is given none."""

SHARD_STORE_ENV = "SHARD_STORE_ENDPOINT"
"""``HOST:PORT`` of a c10d TCPStore hosted outside the ranks; see [Note: A store that outlives
every rank]."""


@dataclass(frozen=True, slots=True)
class LaunchEnv:
    """Where this process sits in its job, as the launcher's environment says.

    Attributes:
        rank: Global rank (``RANK``; 0 when not launched).
        world_size: Number of processes (``WORLD_SIZE``; 1 when not launched).
        local_rank: Rank on this node (``LOCAL_RANK``; when absent,
            ``rank % LOCAL_WORLD_SIZE``, or ``rank`` on a single node).
        master_addr: ``MASTER_ADDR``, or ``None`` when unset.
        master_port: ``MASTER_PORT``, or ``None`` when unset.
        launched: Whether ``RANK`` and ``WORLD_SIZE`` were set at all.
        store: ``SHARD_STORE_ENDPOINT`` as ``(host, port)``, or ``None`` when
            unset (the store is ``MASTER_ADDR:MASTER_PORT``'s).
        attempt: ``TORCHELASTIC_RESTART_COUNT``: 0, or which restart of the
            job this process is.
    """

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None
    launched: bool
    store: tuple[str, int] | None = None
    attempt: int = 0


@dataclass(frozen=True, slots=True)
class InitPlan:
    """What :func:`init_distributed` will do, decided before it does it.

    Attributes:
        backend: The ``torch.distributed`` backend.
        rank: Global rank.
        world_size: Number of processes.
        local_rank: Rank on this node, which picks the device.
        device: The device this process computes on (``cpu``, or ``cuda:<local_rank>``...).
        timeout: Collective timeout; ``None`` keeps torch's default.
        init_method: ``"env://"``, or ``None`` for an in-memory store (world
            of one) or the store below.
        store: ``(host, port)`` of the TCPStore to rendezvous through, under
            the prefix of ``attempt`` (see [Note: A store that outlives every
            rank]); ``None``: ``init_method`` decides.
        attempt: Which restart of the job this process is (0: the first run).
    """

    backend: str
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    timeout: timedelta | None
    init_method: str | None
    store: tuple[str, int] | None = None
    attempt: int = 0


@dataclass(frozen=True, slots=True)
class DistributedState:
    """The process group this process belongs to, as :func:`init_distributed` left it.

    Attributes:
        backend: The default group's backend (``"gloo"``, ``"nccl"``...).
        rank: Global rank.
        world_size: Number of processes.
        local_rank: Rank on this node.
        device: The device this process computes on.
        timeout: The timeout the group was created with; ``None`` for torch's
            default, or when the group was created by someone else.
        adopted: Whether the group existed before ``init_distributed`` was first
            called (created by a launcher or a test harness, say).
    """

    backend: str
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    timeout: timedelta | None
    adopted: bool


def _int_var(environ: Mapping[str, str], key: str) -> int:
    raw = environ[key]
    try:
        return int(raw)
    except ValueError:
        raise DistributedInitError(
            f"environment variable {key}={raw!r} is not an integer; launch with torchrun, "
            "or set RANK, WORLD_SIZE and LOCAL_RANK to integers"
        ) from None


def parse_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read the launcher's variables from ``environ`` (``os.environ`` when ``None``).

    No ``RANK`` and no ``WORLD_SIZE``: a world of one. One without the other,
    a value that is not an integer, or a rank outside the world is a
    :class:`~shard_comms.DistributedInitError` naming the variable.
    """
    env = os.environ if environ is None else environ
    has_rank, has_world = "RANK" in env, "WORLD_SIZE" in env
    if has_rank != has_world:
        present, missing = ("RANK", "WORLD_SIZE") if has_rank else ("WORLD_SIZE", "RANK")
        raise DistributedInitError(
            f"{present} is set but {missing} is not; set both (torchrun does), "
            "or neither for a single process"
        )
    rank = _int_var(env, "RANK") if has_rank else 0
    world_size = _int_var(env, "WORLD_SIZE") if has_world else 1
    if world_size < 1:
        raise DistributedInitError(f"WORLD_SIZE={world_size} must be at least 1")
    if not 0 <= rank < world_size:
        raise DistributedInitError(
            f"RANK={rank} is outside a world of WORLD_SIZE={world_size}; "
            f"ranks run 0..{world_size - 1}"
        )
    if "LOCAL_RANK" in env:
        local_rank = _int_var(env, "LOCAL_RANK")
    elif "LOCAL_WORLD_SIZE" in env:
        local_rank = rank % max(_int_var(env, "LOCAL_WORLD_SIZE"), 1)
    else:
        local_rank = rank
    if local_rank < 0:
        raise DistributedInitError(f"LOCAL_RANK={local_rank} must not be negative")
    port = _int_var(env, "MASTER_PORT") if "MASTER_PORT" in env else None
    attempt = (
        _int_var(env, "TORCHELASTIC_RESTART_COUNT") if "TORCHELASTIC_RESTART_COUNT" in env else 0
    )
    return LaunchEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        master_addr=env.get("MASTER_ADDR"),
        master_port=port,
        launched=has_rank,
        store=_store_endpoint(env),
        attempt=attempt,
    )


def _store_endpoint(env: Mapping[str, str]) -> tuple[str, int] | None:
    """``SHARD_STORE_ENDPOINT`` as ``(host, port)``; ``None`` when unset."""
    raw = env.get(SHARD_STORE_ENV, "").strip()
    if not raw:
        return None
    host, _, port = raw.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 2**16:
        raise DistributedInitError(
            f"{SHARD_STORE_ENV}={raw!r} is not HOST:PORT of a c10d TCPStore (e.g. "
            "127.0.0.1:29400); set it to the store's address, or unset it to rendezvous "
            "through MASTER_ADDR and MASTER_PORT"
        )
    return host.strip("[]"), int(port)


def choose_backend(handle: DeviceHandle) -> str:
    """The backend for ``handle``'s device: its own when usable, gloo otherwise."""
    return handle.backend if handle.is_available() else "gloo"


def _as_timedelta(timeout: timedelta | float | None) -> timedelta | None:
    if timeout is None:
        return None
    value = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    if value <= timedelta(0):
        raise DistributedInitError(
            f"timeout={timeout!r} must be positive; pass seconds or a datetime.timedelta"
        )
    return value


def plan_init(
    launch: LaunchEnv,
    handle: DeviceHandle,
    *,
    backend: str | None = None,
    timeout: timedelta | float | None = None,
) -> InitPlan:
    """Decide backend, device and rendezvous for ``launch`` on ``handle``'s device type."""
    accelerated = handle.device_type != "cpu" and handle.is_available()
    if accelerated:
        count = handle.device_count()
        if launch.local_rank >= count:
            raise DistributedInitError(
                f"LOCAL_RANK={launch.local_rank} but only {count} {handle.device_type} "
                f"device(s) are visible; start at most {count} processes per node"
            )
        device = torch.device(handle.device_type, launch.local_rank)
    else:
        device = torch.device("cpu")
    external = launch.store if launch.world_size > 1 else None
    if (
        launch.world_size > 1
        and external is None
        and (launch.master_addr is None or launch.master_port is None)
    ):
        raise DistributedInitError(
            f"WORLD_SIZE={launch.world_size} needs MASTER_ADDR and MASTER_PORT to find the "
            "other ranks; launch with torchrun, or set both"
        )
    return InitPlan(
        backend=backend if backend is not None else choose_backend(handle),
        rank=launch.rank,
        world_size=launch.world_size,
        local_rank=launch.local_rank,
        device=device,
        timeout=_as_timedelta(timeout),
        init_method="env://" if launch.world_size > 1 and external is None else None,
        store=external,
        attempt=launch.attempt,
    )


def _visible_accelerator() -> str | None:
    """The accelerator type torch sees (``torch.accelerator``, then CUDA), or ``None``."""
    accelerator = current_accelerator_type()
    if accelerator is None and torch.cuda.is_available():
        accelerator = "cuda"
    return None if accelerator == "cpu" else accelerator


def _unserved_accelerator_message(accelerator: str) -> str:
    """Why ``accelerator`` got the CPU handle: no plugin for it, or its plugin declined."""
    opt_out = f"or set {SHARD_DEVICE_ENV}=cpu (or pass device_type='cpu') to run on the CPU"
    try:
        handle = get_registry().device_handle(accelerator)
    except UnknownPluginNameError as error:
        return (
            f"a {accelerator!r} accelerator is visible but shard would run on the CPU with "
            f"gloo: {error}; {opt_out}"
        )
    return (
        f"a {accelerator!r} accelerator is visible but its shard device handle "
        f"({type(handle).__name__}) reports it unusable, so shard would run on the CPU with "
        f"gloo; check the driver and that this build of torch supports {accelerator!r}, "
        f"{opt_out}"
    )


def resolve_device_handle(
    device_type: str | None = None, environ: Mapping[str, str] | None = None
) -> DeviceHandle:
    """The handle ``init_distributed`` uses: never the CPU's by accident on an accelerator.

    ``device_type`` (else ``SHARD_DEVICE`` in ``environ``, ``os.environ`` when
    ``None``) picks the handle explicitly. Without either, the current
    accelerator's handle; if torch sees an accelerator but that resolves to the
    CPU (no plugin serves it, or its plugin finds it unusable), a
    :class:`~shard_comms.DistributedInitError` naming the distribution to install.
    """
    env = os.environ if environ is None else environ
    wanted = device_type if device_type is not None else (env.get(SHARD_DEVICE_ENV) or None)
    handle = get_device_handle(wanted)
    if wanted is None and handle.device_type == "cpu":
        accelerator = _visible_accelerator()
        if accelerator is not None:
            raise DistributedInitError(_unserved_accelerator_message(accelerator))
    return handle


_LOCK = threading.Lock()
_STATE: DistributedState | None = None
# The default group _STATE describes; a group created after a destroy is adopted afresh.
_STATE_GROUP: object = None


def _adopt(device_type: str | None) -> DistributedState:
    backend = str(dist.get_backend())
    rank, world_size = dist.get_rank(), dist.get_world_size()
    launch = parse_launch_env()
    handle = get_device_handle(device_type)
    uses_device = backend != "gloo" and handle.device_type != "cpu" and handle.is_available()
    return DistributedState(
        backend=backend,
        rank=rank,
        world_size=world_size,
        local_rank=launch.local_rank if launch.launched else rank,
        device=handle.current_device() if uses_device else torch.device("cpu"),
        timeout=None,
        adopted=True,
    )


def _check_compatible(
    state: DistributedState,
    backend: str | None,
    timeout: timedelta | None,
    device_type: str | None,
) -> None:
    where = f"(rank {state.rank} of {state.world_size})"
    fix = "drop the argument, or call torch.distributed.destroy_process_group() first"
    if backend is not None and backend != state.backend:
        raise DistributedInitError(
            f"init_distributed(backend={backend!r}) but torch.distributed is already "
            f"initialised with backend {state.backend!r} {where}; {fix}"
        )
    if timeout is not None and not state.adopted and timeout != state.timeout:
        raise DistributedInitError(
            f"init_distributed(timeout={timeout}) but the process group was created with "
            f"timeout={state.timeout} (None: torch's default) {where}; {fix}"
        )
    if device_type is not None and torch.device(device_type).type != state.device.type:
        raise DistributedInitError(
            f"init_distributed(device_type={device_type!r}) but this process already "
            f"computes on {state.device} {where}; {fix}"
        )


def init_distributed(
    *,
    backend: str | None = None,
    timeout: timedelta | float | None = None,
    device_type: str | None = None,
) -> DistributedState:
    """Join the job this process was launched into; idempotent.

    Args:
        backend: The ``torch.distributed`` backend; ``None`` picks the device
            handle's (NCCL on CUDA) when an accelerator is usable, else gloo.
        timeout: Collective timeout, in seconds or as a ``timedelta``; ``None``
            keeps torch's default.
        device_type: The device type whose handle decides; ``None`` reads
            ``SHARD_DEVICE``, else resolves the current accelerator (see
            :func:`resolve_device_handle`: an accelerator no plugin serves is an
            error, not a silent CPU run).

    Sets the current device to ``LOCAL_RANK`` on accelerators. A second call
    returns the same state; one whose arguments contradict the existing
    group raises :class:`~shard_comms.DistributedInitError`. A group created by
    someone else (``torchrun`` scripts that called
    ``init_process_group`` themselves, test harnesses) is adopted.
    """
    global _STATE, _STATE_GROUP
    wanted_timeout = _as_timedelta(timeout)
    with _LOCK:
        if dist.is_initialized():
            world = dist.group.WORLD
            if _STATE is None or _STATE_GROUP is not world:
                _STATE, _STATE_GROUP = _adopt(device_type), world
                _report_on_sigterm(_STATE)
            _check_compatible(_STATE, backend, wanted_timeout, device_type)
            return _STATE
        handle = resolve_device_handle(device_type)
        plan = plan_init(parse_launch_env(), handle, backend=backend, timeout=wanted_timeout)
        if plan.device.type != "cpu":
            handle.set_device(plan.device)
        # A world of one (no init method) rendezvouses in an in-memory store.
        rendezvous: dict[str, Any] = {"init_method": plan.init_method}
        if plan.store is not None:
            rendezvous = {"store": _outside_store(plan)}
        elif plan.init_method is None:
            rendezvous = {"store": HashStore()}
        dist.init_process_group(
            plan.backend,
            **rendezvous,
            rank=plan.rank,
            world_size=plan.world_size,
            timeout=plan.timeout,
            device_id=plan.device if plan.device.type != "cpu" else None,
        )
        _STATE = DistributedState(
            backend=plan.backend,
            rank=plan.rank,
            world_size=plan.world_size,
            local_rank=plan.local_rank,
            device=plan.device,
            timeout=plan.timeout,
            adopted=False,
        )
        _STATE_GROUP = dist.group.WORLD
        _report_on_sigterm(_STATE)
        return _STATE


def _outside_store(plan: InitPlan) -> Store:
    """A client of the store at ``plan.store``, under this attempt's prefix.

    See [Note: A store that outlives every rank].
    """
    assert plan.store is not None
    host, port = plan.store
    timeout = plan.timeout if plan.timeout is not None else timedelta(minutes=30)
    try:
        client = TCPStore(host, port, is_master=False, timeout=timeout)
    except (RuntimeError, dist.DistError) as error:
        raise DistributedInitError(
            f"cannot reach the c10d store at {host}:{port} ({SHARD_STORE_ENV}): {error}; "
            "start the ranks with the launcher that hosts it (shard train), or unset "
            f"{SHARD_STORE_ENV}"
        ) from error
    return PrefixStore(f"shard/attempt/{plan.attempt}", client)  # keys: shard/attempt/N/KEY


def _report_on_sigterm(state: DistributedState) -> None:
    """In a launched job of several ranks, report on SIGTERM (see ``_terminate.py``)."""
    if state.world_size > 1 and parse_launch_env().launched:
        _terminate.install(termination_report)
