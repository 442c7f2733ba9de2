"""SIGTERM from a launcher: say what went wrong first, within a bound, then end as asked.

[Note: SIGTERM from a launcher]
When one rank dies, an elastic launcher (``torchrun``, ``shard train``) sends
SIGTERM to every other rank within its monitor interval (0.1 s for torchrun,
0.5 s under ``shard train``) and SIGKILL 30 s later. SIGTERM's default
action ends a process at once, wherever it is: a rank that had not yet
reached a collective with the dead one (it was computing, or in its
optimizer step) never says what happened, and the job's output names
nothing but the launcher's exit code. So :func:`~shard_comms.init_distributed`
installs :func:`install`'s handler (a launched job of several ranks, on the
main thread, SIGTERM still at its default action, ``SHARD_SIGTERM_GRACE_S``
above 0). On SIGTERM the rank publishes its flight record through the c10d
store and reads its peers' (``_diagnose.termination_report``) for at most the
grace, ``SHARD_SIGTERM_GRACE_S`` seconds (3 by default); writes to stderr
what it found when a rank did not answer or two records differ; and then
ends by SIGTERM after all, so the launcher sees the exit status it would
have seen without shard.
- The bound: every rank that receives SIGTERM publishes at once, so when the
  whole job is being stopped (Ctrl-C of the launcher, a preemption) every
  rank finds the others' records within tens of milliseconds and ends
  without a word; only a rank that does not answer (dead, or stuck outside
  Python) makes the others wait, never longer than the grace.
- Wherever the main thread is: Python runs a signal handler on the main
  thread between bytecodes, so a main thread blocked inside a collective
  would run it late. The work runs in a watcher thread instead, woken by the
  signal itself (``signal.set_wakeup_fd``, when no one else uses it: asyncio
  does); the handler on the main thread only waits for it and then ends the
  process. A main thread that has not come back by the grace plus
  ``_EXIT_MARGIN_S`` is not waited for: the watcher ends the process with
  exit status 143 (128 + SIGTERM, as a shell reports a SIGTERM).
- A collective that failed first: its own exchange (``_diagnose.py``) is under
  way, and the signal only shortens it to the grace; the failure's message
  is written to stderr before the rank ends.
- A process forked from the rank (a data loader worker) gets SIGTERM's
  default action back, and no share in the wake-up pipe.

[Note: The console of install time]
A program may point file descriptor 2 elsewhere for a while: ``shard
train`` captures it during its profiled steps to drop one of the profiler's
notices, and replays the rest afterwards. A rank ended by SIGTERM inside
such a block never replays it, so whatever it wrote there is lost.
:func:`write_console` therefore writes to ``sys.stderr`` and also, when
descriptor 2 no longer is the file it was when :func:`install` ran, to a
copy of that one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

from shard_core.errors import CommError

__all__ = [
    "DEFAULT_GRACE_S",
    "GRACE_ENV",
    "end_as_asked",
    "exchange_deadline",
    "exchanging",
    "grace_seconds",
    "install",
    "installed",
    "terminated",
    "write_console",
]

GRACE_ENV = "SHARD_SIGTERM_GRACE_S"
DEFAULT_GRACE_S = 3.0
"""Seconds a terminated rank may spend reporting when ``SHARD_SIGTERM_GRACE_S`` is not set."""

# How long after the grace the watcher still waits for the main thread to end the process.
_EXIT_MARGIN_S = 1.0
_EXIT_STATUS = 128 + int(signal.SIGTERM)


def grace_seconds() -> float:
    """``SHARD_SIGTERM_GRACE_S`` as seconds (3 when unset); 0 turns the report off."""
    raw = os.environ.get(GRACE_ENV, "").strip()
    if not raw:
        return DEFAULT_GRACE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0.0:  # also refuses nan
        raise CommError(
            f"{GRACE_ENV}={raw!r} is not a number of seconds; set it to e.g. 3 (how long a "
            "rank stopped by SIGTERM may spend reporting), or 0 to end at once"
        )
    return value


class _Termination:
    """This process's handler state; see [Note: SIGTERM from a launcher]."""

    def __init__(self, grace: float, report: Callable[[float], str | None]) -> None:
        self.pid = os.getpid()
        self.grace = grace
        self.report = report
        # See [Note: The console of install time].
        self.console = os.dup(2)
        self.lock = threading.Lock()
        # - set once, on the first SIGTERM
        self.received: float | None = None  # time.monotonic() of the signal
        self.report_started = False
        self.reported = threading.Event()
        # - the main thread's failed collective is exchanging records (_diagnose.py)
        self.exchanging = 0

    def deadline(self) -> float | None:
        """When the rank must be done reporting (monotonic); ``None`` before any SIGTERM."""
        return None if self.received is None else self.received + self.grace

    def note(self) -> None:
        """Record the signal; start the report unless a failed collective is reporting."""
        with self.lock:
            if self.received is None:
                self.received = time.monotonic()
            if self.exchanging or self.report_started:
                return
            self.report_started = True
        threading.Thread(target=self._report, name="shard-sigterm-report", daemon=True).start()

    def _report(self) -> None:
        deadline = self.deadline()
        assert deadline is not None
        try:
            text = self.report(deadline)
        except Exception as problem:  # never keep a terminated rank alive over its report
            text = f"shard: the SIGTERM report failed: {type(problem).__name__}: {problem}"
        if text:
            write_console(text)
        self.reported.set()

    def wait_reported(self) -> None:
        deadline = self.deadline()
        remaining = 0.0 if deadline is None else deadline - time.monotonic()
        # The report's own polling stops at the deadline; a little more for its last words.
        self.reported.wait(max(0.0, remaining) + 0.5)


_STATE: _Termination | None = None


def write_console(text: str) -> None:
    """Write ``text`` and a newline to stderr; see [Note: The console of install time]."""
    data = text + "\n"
    with contextlib.suppress(Exception):
        sys.stderr.write(data)
        sys.stderr.flush()
    state = _STATE
    if state is None or state.pid != os.getpid():
        return
    try:
        now, then = os.fstat(2), os.fstat(state.console)
        if (now.st_dev, now.st_ino) == (then.st_dev, then.st_ino):
            return
        view = memoryview(data.encode(errors="replace"))
        while view:
            view = view[os.write(state.console, view) :]
    except OSError:
        pass


def installed() -> bool:
    """Whether this process reports on SIGTERM (see :func:`install`)."""
    state = _STATE
    return state is not None and state.pid == os.getpid()


def terminated() -> bool:
    """Whether this process has received SIGTERM (only known once :func:`install` ran)."""
    state = _STATE
    return state is not None and state.pid == os.getpid() and state.received is not None


def exchange_deadline(deadline: float) -> float:
    """``deadline`` (monotonic), or the grace's end if SIGTERM came and that is sooner."""
    state = _STATE
    end = state.deadline() if state is not None else None
    return deadline if end is None else min(deadline, end)


@contextlib.contextmanager
def exchanging() -> Iterator[None]:
    """Mark a failed collective's exchange of records: SIGTERM only shortens it."""
    state = _STATE
    if state is None:
        yield
        return
    with state.lock:
        state.exchanging += 1
    try:
        yield
    finally:
        with state.lock:
            state.exchanging -= 1


def end_as_asked() -> None:
    """End this process by SIGTERM's default action; see the module's note.

    Only the main thread may restore the default action; another thread
    (a collective that failed on an autograd thread) ends the process with
    exit status 143 instead, as the watcher does.
    """
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5.0)  # the signal is delivered before this returns; never reached
    os._exit(_EXIT_STATUS)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    state = _STATE
    if state is None or state.pid != os.getpid():  # a forked child that kept the handler
        end_as_asked()
        return
    state.note()
    with state.lock:
        if state.exchanging:
            return  # _diagnose writes the failure, then ends the process
    state.wait_reported()
    end_as_asked()


def _watch(read_fd: int, state: _Termination) -> None:
    """Wake on SIGTERM even while the main thread is blocked; bound the process's life."""
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        if int(signal.SIGTERM) not in data or signal.getsignal(signal.SIGTERM) is not _on_sigterm:
            continue
        state.note()
        deadline = state.deadline()
        assert deadline is not None
        time.sleep(max(0.0, deadline + _EXIT_MARGIN_S - time.monotonic()))
        # The main thread did not end the process: it is blocked outside Python.
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(_EXIT_STATUS)


def _forget_in_child() -> None:
    """After ``fork``: the child does not report, and stops writing to the parent's pipe."""
    global _STATE
    if _STATE is None:
        return
    _STATE = None
    with contextlib.suppress(ValueError, OSError):
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.set_wakeup_fd(-1)


_AT_FORK_REGISTERED = False


def install(report: Callable[[float], str | None], grace: float | None = None) -> bool:
    """Report on SIGTERM with ``report`` (given the deadline), then end; whether installed.

    Installs nothing (and returns False) off the main thread, when SIGTERM's
    handler is not the default one (the program has its own), or when the
    grace is 0. Idempotent. See [Note: SIGTERM from a launcher].
    """
    global _STATE, _AT_FORK_REGISTERED
    if installed():
        return True
    grace = grace_seconds() if grace is None else grace
    if (
        grace <= 0
        or threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        return False
    state = _Termination(grace, report)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:
        previous = -2
    if previous != -1:  # someone else's wake-up fd (asyncio): put it back, go without
        if previous >= 0:
            signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
    else:
        watcher = threading.Thread(
            target=_watch, args=(read_fd, state), name="shard-sigterm-watch", daemon=True
        )
        watcher.start()
    _STATE = state
    signal.signal(signal.SIGTERM, _on_sigterm)
    if not _AT_FORK_REGISTERED:
        os.register_at_fork(after_in_child=_forget_in_child)
        _AT_FORK_REGISTERED = True
    return True
