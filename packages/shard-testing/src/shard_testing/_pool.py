"""A persistent pool of gloo ranks for multi-rank tests.

[Note: Why a pool]
Starting a process and importing torch costs a second or more of CPU per
rank; hundreds of multi-rank tests at world sizes 1..4 on a 2-core CI
machine cannot pay that per test. A ``RankPool`` keeps one group of worker
processes per world size for as long as it lives (a pytest session: world
sizes 1..4 make 10 processes) and sends each run's function to every rank
of the group of that world size. Runs never overlap: the pool waits for
every rank before it returns, which is all the isolation two runs need.

[Note: Failure handling]
A run ends when every rank has replied. Once one rank fails (raises, or its
process dies), the others may be blocked in a collective that can never
complete, so the pool waits at most ``grace`` more seconds for them, then
kills the group and raises ``RankFailure`` naming the failed ranks with
their tracebacks and the ranks that never finished. A group that saw any
failure is never reused (its process group may be out of step): the next
run at that world size starts a fresh one. A run that exceeds its timeout
kills the group and raises ``RankTimeout``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any, TypeVar

from shard_testing._errors import RankFailure, RankTimeout
from shard_testing._transport import describe, pickle_task
from shard_testing._worker import (
    ERROR,
    EXIT,
    PORT,
    READY,
    RUN,
    WarningFilter,
    WorkerSpec,
    worker_main,
)

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "DEFAULT_GRACE_S",
    "DEFAULT_START_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "RankPool",
]

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_GRACE_S = 5.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0
DEFAULT_START_TIMEOUT_S = 120.0

_EXIT_WAIT_S = 5.0  # how long a worker may take to exit before it is killed
_OUTPUT_TAIL_CHARS = 2000  # how much of a dead rank's output its failure quotes


class RankPool:
    """Long-lived gloo ranks, one group of processes per world size.

    A group starts on the first :meth:`run` at its world size and lives until
    :meth:`close` (or the end of the ``with`` block, or interpreter exit),
    except that a failed or timed-out run discards it and the next run at
    that world size starts a fresh one. Not thread-safe.

    Args:
        timeout: Seconds a :meth:`run` may take when it passes no ``timeout``.
        grace: Seconds the other ranks get to finish after the first rank
            fails, before the group is killed.
        collective_timeout: Seconds a collective waits for its peers before
            it raises on the ranks (the default process group's timeout), so
            that mismatched collectives fail instead of hanging.
        start_timeout: Seconds a group may take to start (processes, import
            torch, gloo rendezvous).
    """

    def __init__(
        self,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        grace: float = DEFAULT_GRACE_S,
        collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
    ) -> None:
        self._timeout = _check_seconds("timeout", timeout)
        self._grace = _check_seconds("grace", grace, allow_zero=True)
        self._collective_timeout = _check_seconds("collective_timeout", collective_timeout)
        self._start_timeout = _check_seconds("start_timeout", start_timeout)
        self._groups: dict[int, _Group] = {}
        # Stops the workers when the pool is collected or at interpreter exit.
        self._finalizer = weakref.finalize(self, _close_groups, self._groups)

    @property
    def timeout(self) -> float:
        """Seconds a :meth:`run` may take when it passes no ``timeout``."""
        return self._timeout

    @property
    def world_sizes(self) -> tuple[int, ...]:
        """World sizes whose groups are running now, ascending."""
        return tuple(sorted(self._groups))

    def run(
        self,
        fn: Callable[..., T],
        world_size: int,
        *args: Any,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[T]:
        """Run ``fn(*args, **kwargs)`` on every rank of a group of ``world_size`` processes.

        ``fn`` must be defined at module level (of a test file or of an
        importable module); the ranks find it by file and qualified name.
        Arguments and return values travel by pickle. On each rank the
        default process group (gloo) is initialised and ``RANK``,
        ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
        ``MASTER_ADDR`` and ``MASTER_PORT`` are set. Warning filters active
        here (pytest's ``filterwarnings``) apply on the ranks too.

        Returns:
            The per-rank return values, in rank order.

        Raises:
            RankFailure: a rank raised or died (see [Note: Failure handling]).
            RankTimeout: ranks did not finish within ``timeout`` seconds
                (default: the pool's ``timeout``).
            TypeError: ``fn`` or the arguments cannot be sent to the ranks.
        """
        __tracebackhide__ = True  # pytest shows the test's frame, not the pool's
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        seconds = self._timeout if timeout is None else _check_seconds("timeout", timeout)
        name = describe(fn)
        task, modules = _pack(fn, name, args, kwargs)
        group = self._groups.get(world_size)
        if group is None:
            group = _Group(
                world_size,
                grace=self._grace,
                collective_timeout=self._collective_timeout,
                start_timeout=self._start_timeout,
            )
            self._groups[world_size] = group
        try:
            blobs = group.run(modules, task, timeout=seconds, name=name)
        finally:
            if not group.alive:
                self._groups.pop(world_size, None)
        results: list[T] = []
        for rank, blob in enumerate(blobs):
            try:
                results.append(pickle.loads(blob))
            except Exception as exc:
                message = (
                    f"rank {rank} of {world_size} returned a value from {name} that this "
                    f"process cannot unpickle: {exc!r}"
                )
                raise RankFailure(
                    message, world_size=world_size, failures={rank: repr(exc)}
                ) from exc
        return results

    def close(self) -> None:
        """Tell every worker to exit; kill those that do not within a few seconds.

        The pool stays usable: a later :meth:`run` starts fresh groups.
        """
        _close_groups(self._groups)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RankPool(timeout={self._timeout}, running world sizes={list(self.world_sizes)})"


def _close_groups(groups: dict[int, _Group]) -> None:
    for group in list(groups.values()):
        group.stop(graceful=True)
    groups.clear()


def _check_seconds(name: str, value: float, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero) or value != value:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound} seconds, got {value!r}")
    return float(value)


def _pack(
    fn: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[bytes, dict[str, str]]:
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    qualname = getattr(fn, "__qualname__", "")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(
            f"{name} cannot be sent to the ranks: define rank functions at module level "
            "(not nested in a function, not a lambda)"
        )
    filters = _warning_filters()
    try:
        return pickle_task((fn, args, kwargs, filters))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise TypeError(
            f"cannot send {name} and its arguments to the ranks: {exc}; define the function "
            "at module level and pass picklable arguments"
        ) from exc


def _warning_filters() -> list[WarningFilter]:
    """``warnings.filters`` as picklable text, so the ranks apply the test's filters."""
    filters: list[WarningFilter] = []
    for action, message, category, module, lineno in warnings.filters:
        if not isinstance(category, type) or "<locals>" in category.__qualname__:
            continue
        filters.append(
            (
                action,
                _pattern(message),
                category,
                _pattern(module),
                lineno,
            )
        )
    return filters


def _pattern(regex: re.Pattern[str] | str | None) -> str:
    if regex is None:
        return ""
    return regex if isinstance(regex, str) else regex.pattern


@dataclass
class _Replies:
    """What one round of waiting on the ranks produced."""

    received: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    exit_codes: dict[int, int | None] = field(default_factory=dict)  # ranks whose process ended
    unfinished: list[int] = field(default_factory=list)

    @property
    def failed(self) -> list[int]:
        errors = [rank for rank, reply in self.received.items() if reply[0] == ERROR]
        return sorted([*errors, *self.exit_codes])


class _Group:
    """The worker processes of one world size. See [Note: Worker life cycle] in ``_worker.py``."""

    def __init__(
        self, world_size: int, *, grace: float, collective_timeout: float, start_timeout: float
    ) -> None:
        self.world_size = world_size
        self.alive = True
        self._grace = grace
        self._directory = tempfile.mkdtemp(prefix=f"shard-rank-pool-{world_size}-")
        self._processes: list[BaseProcess] = []
        self._conns: list[Connection] = []
        context = multiprocessing.get_context("spawn")
        try:
            for rank in range(world_size):
                spec = WorkerSpec(
                    rank=rank,
                    world_size=world_size,
                    parent_pid=os.getpid(),
                    output_path=self._output_path(rank),
                    collective_timeout=collective_timeout,
                    start_timeout=start_timeout,
                )
                parent_conn, child_conn = context.Pipe()
                process = context.Process(
                    target=worker_main,
                    args=(spec, child_conn),
                    name=f"shard-rank-{rank}-of-{world_size}",
                    daemon=True,
                )
                self._conns.append(parent_conn)
                try:
                    process.start()
                finally:
                    child_conn.close()
                self._processes.append(process)
            self._rendezvous(start_timeout)
        except BaseException:
            self.stop(graceful=False)
            raise

    def run(
        self, modules: Mapping[str, str], task: bytes, *, timeout: float, name: str
    ) -> list[bytes]:
        """Send one task to every rank and return the pickled results in rank order."""
        __tracebackhide__ = True
        message = pickle.dumps((RUN, dict(modules), task), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for rank in range(self.world_size):
                self._send(rank, message)
            replies = self._collect(range(self.world_size), time.monotonic() + timeout)
        except BaseException:
            self.stop(graceful=False)
            raise
        if replies.failed or replies.unfinished:
            outputs = self.stop(graceful=False)
            _echo(outputs, self.world_size)
            raise self._error(replies, outputs, doing=f"running {name}", timeout=timeout)
        _echo(self._read_outputs(), self.world_size)
        if not all(reply[2] for reply in replies.received.values()):
            # The function destroyed the default process group: start afresh next time.
            self.stop(graceful=True)
        return [replies.received[rank][1] for rank in range(self.world_size)]

    def stop(self, *, graceful: bool) -> dict[int, str]:
        """Stop the workers (asking them to exit first when ``graceful``); return their output."""
        if self.alive:
            self.alive = False
            if graceful:
                for rank in range(len(self._conns)):
                    self._send(rank, pickle.dumps((EXIT,)))
                deadline = time.monotonic() + _EXIT_WAIT_S
                for process in self._processes:
                    process.join(max(0.0, deadline - time.monotonic()))
            for process in self._processes:
                if process.exitcode is None:
                    process.kill()
            for process in self._processes:
                process.join(_EXIT_WAIT_S)
            for conn in self._conns:
                conn.close()
        outputs = self._read_outputs()
        shutil.rmtree(self._directory, ignore_errors=True)
        return outputs

    # - start-up

    def _rendezvous(self, start_timeout: float) -> None:
        deadline = time.monotonic() + start_timeout
        replies = self._collect([0], deadline)
        if not replies.failed and not replies.unfinished:
            (tag, port) = replies.received[0]
            assert tag == PORT, tag
            for rank in range(1, self.world_size):
                self._send(rank, pickle.dumps((PORT, port)))
            replies = self._collect(range(self.world_size), deadline)
        if replies.failed or replies.unfinished:
            outputs = self.stop(graceful=False)
            raise self._error(replies, outputs, doing="starting", timeout=start_timeout)
        assert all(reply[0] == READY for reply in replies.received.values())

    # - messages

    def _send(self, rank: int, message: bytes) -> None:
        # A worker that is gone cannot take it; _collect reports how it ended.
        with contextlib.suppress(OSError):
            self._conns[rank].send_bytes(message)

    def _collect(self, ranks: Iterable[int], deadline: float) -> _Replies:
        """Wait for one message from each of ``ranks``. See [Note: Failure handling]."""
        replies = _Replies()
        pending = set(ranks)
        first_failure: float | None = None
        while pending:
            limit = deadline
            if first_failure is not None:
                limit = min(deadline, first_failure + self._grace)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            owners: dict[Any, int] = {}
            for rank in pending:
                owners[self._conns[rank]] = rank
                owners[self._processes[rank].sentinel] = rank
            for ready in wait(list(owners), timeout=remaining):
                rank = owners[ready]
                if rank not in pending:
                    continue
                pending.discard(rank)
                reply = self._receive(rank)
                if reply is None:
                    replies.exit_codes[rank] = self._reap(rank)
                else:
                    replies.received[rank] = reply
            if first_failure is None and replies.failed:
                first_failure = time.monotonic()
        replies.unfinished = sorted(pending)
        return replies

    def _receive(self, rank: int) -> tuple[Any, ...] | None:
        """The rank's message, or ``None`` when its process ended without one."""
        conn = self._conns[rank]
        try:
            if not conn.poll():
                return None
            reply: tuple[Any, ...] = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return None
        return reply

    def _reap(self, rank: int) -> int | None:
        process = self._processes[rank]
        process.join(_EXIT_WAIT_S)
        if process.exitcode is None:
            process.kill()
            process.join(_EXIT_WAIT_S)
        return process.exitcode

    # - output and errors

    def _output_path(self, rank: int) -> str:
        return os.path.join(self._directory, f"rank{rank}.out")

    def _read_outputs(self) -> dict[int, str]:
        outputs: dict[int, str] = {}
        for rank in range(self.world_size):
            try:
                with open(self._output_path(rank), encoding="utf-8", errors="replace") as file:
                    outputs[rank] = file.read()
            except FileNotFoundError:
                outputs[rank] = ""
        return outputs

    def _error(
        self, replies: _Replies, outputs: Mapping[int, str], *, doing: str, timeout: float
    ) -> AssertionError:
        size = self.world_size
        if not replies.failed:
            if doing == "starting":
                hint = "pass a larger start_timeout= to RankPool"
            else:
                hint = "pass a larger timeout= to run() or --shard-pool-timeout to pytest"
            return RankTimeout(
                f"{_ranks(replies.unfinished)} of {size} did not finish {doing} within "
                f"{timeout:g} s; the pool of world size {size} was killed and the next run "
                f"starts a fresh one. If the work is legitimately slow, {hint}.",
                world_size=size,
                unfinished=replies.unfinished,
                timeout=timeout,
            )
        failures: dict[int, str] = {}
        for rank in replies.failed:
            if rank in replies.received:
                failures[rank] = replies.received[rank][1]
            else:
                failures[rank] = _describe_exit(replies.exit_codes[rank], outputs.get(rank, ""))
        lines = [f"{_ranks(replies.failed)} of {size} failed {doing}:"]
        for rank, text in failures.items():
            lines.append(f"----- rank {rank} -----")
            lines.append(text.rstrip("\n"))
        if replies.unfinished:
            lines.append(
                f"{_ranks(replies.unfinished)} did not finish within {self._grace:g} s of the "
                f"first failure and {'was' if len(replies.unfinished) == 1 else 'were'} killed."
            )
        lines.append(
            f"The pool of world size {size} was discarded; the next run starts a fresh one."
        )
        return RankFailure(
            "\n".join(lines),
            world_size=size,
            failures=failures,
            unfinished=replies.unfinished,
        )


def _describe_exit(code: int | None, output: str) -> str:
    if code is None:
        text = "closed its connection without replying and was killed"
    elif code < 0:
        try:
            signame = signal.Signals(-code).name
        except ValueError:
            signame = f"signal {-code}"
        text = f"was killed by {signame} (exit code {code})"
    else:
        text = f"died with exit code {code}"
    if output:
        text += f"; its output ended with:\n{output[-_OUTPUT_TAIL_CHARS:]}"
    return text


def _ranks(ranks: Iterable[int]) -> str:
    ordered = sorted(ranks)
    if len(ordered) == 1:
        return f"rank {ordered[0]}"
    return "ranks " + ", ".join(str(rank) for rank in ordered)


def _echo(outputs: Mapping[int, str], world_size: int) -> None:
    """Copy the ranks' output to this process's stdout (pytest shows it for failing tests)."""
    for rank, text in sorted(outputs.items()):
        if text:
            newline = "" if text.endswith("\n") else "\n"
            sys.stdout.write(f"----- output of rank {rank} of {world_size} -----\n{text}{newline}")
    sys.stdout.flush()
