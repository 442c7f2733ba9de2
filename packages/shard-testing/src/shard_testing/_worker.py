"""The process behind one rank of a :class:`~shard_testing.RankPool`.

A worker is started once per rank and serves task after task until the pool
tells it to exit, so a test pays for ``import torch`` and the gloo rendezvous
once per session instead of once per test.

[Note: Worker life cycle]
1. Start-up: redirect fds 1 and 2 to the rank's output file (with
   ``faulthandler`` on, so a crash leaves its Python stack there), ignore SIGINT
   (Ctrl-C reaches the whole process group; the pool, not the worker, decides
   what to do), start a watchdog that exits when the parent process is gone,
   set the ``torchrun`` environment, ``torch.set_num_threads(1)``, and
   initialise the default process group (gloo). Rank 0 hosts the TCP store
   on a port the OS picks and reports it; the pool relays it to the other
   ranks, so two pools never race for a port.
2. Serving: each task is ``(modules, payload)``; the worker loads the source
   files in ``modules`` (see [Note: Functions travel by reference] in
   ``_transport.py``), unpickles ``(fn, args, kwargs, warning filters)``,
   runs ``fn`` under the parent's warning filters and replies with the
   pickled result or the formatted traceback. Between tasks it resets what
   tests commonly change (see ``_reset_between_tasks``).
3. Exit: ``dist.destroy_process_group()``, flush, ``os._exit(0)``. A worker
   never tears its interpreter down normally: gloo can abort with
   "terminate called without an active exception" during interpreter
   finalisation.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Literal, NoReturn

from shard_testing._transport import load_source_modules

__all__ = [
    "ERROR",
    "EXIT",
    "MASTER_ADDR",
    "OK",
    "PORT",
    "READY",
    "RUN",
    "WarningFilter",
    "WorkerSpec",
    "worker_main",
]

MASTER_ADDR = "127.0.0.1"

# Messages are pickled tuples whose first item is one of these tags.
# - worker -> pool
PORT: Literal["port"] = "port"  # ("port", int): rank 0's store port; also pool -> ranks 1..N-1
READY: Literal["ready"] = "ready"  # ("ready",): the default process group is initialised
OK: Literal["ok"] = "ok"  # ("ok", result bytes, default group still initialised)
ERROR: Literal["error"] = "error"  # ("error", traceback text)
# - pool -> worker
RUN: Literal["run"] = "run"  # ("run", {module name: source path}, payload bytes)
EXIT: Literal["exit"] = "exit"  # ("exit",)

WarningFilter = tuple[str, str, type[Warning], str, int]
"""One entry of ``warnings.filters`` as text: action, message, category, module, lineno."""

_WATCHDOG_PERIOD_S = 1.0


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker needs to start.

    Attributes:
        rank: This worker's rank in the default process group.
        world_size: Number of ranks in the pool.
        parent_pid: The pool's process; the worker exits when it is gone.
        output_path: File that receives the worker's stdout and stderr.
        collective_timeout: Seconds a collective may wait for its peers.
        start_timeout: Seconds the TCP store rendezvous may take.
    """

    rank: int
    world_size: int
    parent_pid: int
    output_path: str
    collective_timeout: float
    start_timeout: float


def worker_main(spec: WorkerSpec, conn: Connection) -> NoReturn:
    """Start one rank and serve tasks until told to exit. See [Note: Worker life cycle]."""
    _redirect_output(spec.output_path)
    faulthandler.enable()  # a crash leaves the Python stack in the rank's output
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _start_watchdog(spec.parent_pid)
    try:
        _init_distributed(spec, conn)
    except BaseException:
        _send(conn, (ERROR, "the rank could not start:\n" + traceback.format_exc()))
        _exit(1)
    _send(conn, (READY,))
    _serve(conn)


def _redirect_output(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _start_watchdog(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_WATCHDOG_PERIOD_S)
        os._exit(1)

    threading.Thread(target=watch, name="shard-rank-pool-watchdog", daemon=True).start()


def _init_distributed(spec: WorkerSpec, conn: Connection) -> None:
    os.environ.update(
        RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_RANK=str(spec.rank),
        LOCAL_WORLD_SIZE=str(spec.world_size),
        MASTER_ADDR=MASTER_ADDR,
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    tcp_store = dist.TCPStore  # type: ignore[attr-defined]  # public, but not in __all__
    store_timeout = timedelta(seconds=spec.start_timeout)
    if spec.rank == 0:
        store = tcp_store(
            MASTER_ADDR,
            0,
            spec.world_size,
            is_master=True,
            timeout=store_timeout,
            wait_for_workers=False,
        )
        port = store.port
        _send(conn, (PORT, port))
    else:
        tag, port = pickle.loads(conn.recv_bytes())
        if tag != PORT:
            raise RuntimeError(f"expected the store port from the pool, got {tag!r}")
        store = tcp_store(
            MASTER_ADDR, port, spec.world_size, is_master=False, timeout=store_timeout
        )
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(
        "gloo",
        store=store,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.collective_timeout),
    )


def _serve(conn: Connection) -> NoReturn:
    environ = dict(os.environ)
    cwd = os.getcwd()
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the pool is gone
            _exit(0)
        if message[0] == EXIT:
            _shutdown()
        _truncate_output()
        reply = _run_task(message[1], message[2])
        _reset_between_tasks(environ, cwd)
        sys.stdout.flush()
        sys.stderr.flush()
        _send(conn, reply)


def _run_task(modules: dict[str, str], payload: bytes) -> tuple[Any, ...]:
    import torch.distributed as dist

    try:
        load_source_modules(modules)
        fn, args, kwargs, filters = pickle.loads(payload)
    except BaseException:
        return (ERROR, "the rank could not receive the task:\n" + traceback.format_exc())
    with warnings.catch_warnings():
        if filters is not None:
            _apply_warning_filters(filters)
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            # Drop this frame: the traceback starts in the test's function.
            frames = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
            lines = traceback.format_exception(type(exc), exc, frames)
            return (ERROR, "".join(lines))
    try:
        data = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:
        return (
            ERROR,
            f"the value returned by {fn.__qualname__} (a {type(result).__qualname__}) could not "
            "be pickled; return tensors, numbers and containers of them:\n"
            + traceback.format_exc(),
        )
    return (OK, data, dist.is_initialized())


def _apply_warning_filters(filters: list[WarningFilter]) -> None:
    warnings.resetwarnings()
    for action, message, category, module, lineno in reversed(filters):
        warnings.filterwarnings(action, message, category, module, lineno)  # type: ignore[arg-type]


def _reset_between_tasks(environ: dict[str, str], cwd: str) -> None:
    """Undo what tests commonly change, cheaply.

    Reset: default dtype (float32), default device (CPU), grad mode (enabled),
    intra-op threads (1), ``os.environ`` and the working directory. Not
    reset: random seeds (tests seed what they use), process groups a test
    created, module-level state of the test's own code.
    """
    import torch

    torch.set_default_dtype(torch.float32)
    torch.set_default_device(None)
    torch.set_grad_enabled(True)
    torch.set_num_threads(1)
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    if os.getcwd() != cwd:
        os.chdir(cwd)


def _truncate_output() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.ftruncate(1, 0)


def _shutdown() -> NoReturn:
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        _exit(0)


def _send(conn: Connection, message: tuple[Any, ...]) -> None:
    try:
        conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
    except OSError:  # the pool is gone
        _exit(0)


def _exit(code: int) -> NoReturn:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)
