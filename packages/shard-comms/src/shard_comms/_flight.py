"""The flight recorder: the last collectives this process issued, always on.

A fixed ring of :class:`FlightEntry` per process, one entry per collective
shard issues (every collective of ``_collectives.py``): its sequence number
in its process group, the op, the unit label, the phase (``forward
all-gather``, ``backward all-gather``, ``reduce-scatter``, ``all-reduce``,
``broadcast``...), the training step, the group's ranks, sizes, dtype, start
and end times and state. When a collective fails, ``_diagnose.py`` reads this
ring on every rank (through the c10d store) to say who diverged, who is
behind and who is dead.

[Note: Flight recorder cost]
The recorder runs on every collective of every step, so it does the least
it can there: one small object with slots per collective, written over the
oldest in a preallocated list, under one lock (autograd threads issue
collectives too); the dtype and the group are kept as objects and turned
into text only when a summary is asked for. ``tools/bench/bench_flight.py``
measures it: about 1-2 us per collective (issue and complete), far under 1%
of a training step. ``SHARD_FLIGHT_RECORDER`` sets the ring's size (2048 by
default); ``0`` turns the recorder off.

[Note: Sequence numbers]
A collective's sequence number counts the collectives shard issued on its
process group in this process, from 0. Ranks that issue the same collectives
in the same order give each one the same number, so comparing two ranks'
records entry by entry, sequence number by sequence number, finds the first
collective where they disagree. A new default process group (a job that
re-initialises) starts a new record: the ring is cleared.

[Note: Which step a record names]
An entry's step is the step the training loop shows, when the loop says it:
:func:`set_training_step` (``shard train`` calls it with its own steps, 1
first, continued across ``--resume`` and restarts), so that "step 5" in a
failure is the step 5 the user saw. A loop that never calls it gets the
runtime's count: the root's completed backwards, 0 in the first iteration
(what ``for step in range(n)`` shows), which the runtime sets through
:func:`set_flight_step` at every root forward and at the end of every
backward. The runtime's count cannot stand for the loop's: it starts at 0
in every process, so after a resume or a restart it is the loop's step
minus the checkpoint's; and it moves at the end of backward, so the
collectives of the optimizer step and of the end of the step would name
the next step.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from shard_core.errors import CommError

__all__ = [
    "FlightEntry",
    "FlightRecorder",
    "FlightState",
    "flight_recorder",
    "reset_flight_recorder",
    "set_flight_step",
    "set_training_step",
]

FlightState = Literal["issued", "completed", "failed"]

DEFAULT_CAPACITY = 2048
"""Entries the ring keeps when ``SHARD_FLIGHT_RECORDER`` is not set."""

_ENV = "SHARD_FLIGHT_RECORDER"


class FlightEntry:
    """One collective in the ring. Plain attributes; :meth:`as_dict` for JSON."""

    __slots__ = (
        "dtype",
        "end",
        "group",
        "label",
        "nbytes",
        "numel",
        "op",
        "phase",
        "ranks",
        "seq",
        "start",
        "state",
        "step",
    )

    def __init__(
        self,
        seq: int,
        op: str,
        label: str | None,
        phase: str,
        step: int,
        group: str,
        ranks: tuple[int, ...],
        numel: int,
        nbytes: int,
        dtype: torch.dtype | str,
    ) -> None:
        self.seq = seq
        self.op = op
        self.label = label
        self.phase = phase
        self.step = step
        self.group = group
        self.ranks = ranks
        self.numel = numel
        self.nbytes = nbytes
        self.dtype = dtype
        self.start = time.time()
        self.end: float | None = None
        self.state: FlightState = "issued"

    def as_dict(self) -> dict[str, Any]:
        """The entry as JSON-ready values (dtype as its name, e.g. ``"float32"``)."""
        dtype = self.dtype
        return {
            "seq": self.seq,
            "op": self.op,
            "label": self.label,
            "phase": self.phase,
            "step": self.step,
            "group": self.group,
            "ranks": list(self.ranks),
            "numel": self.numel,
            "nbytes": self.nbytes,
            "dtype": str(dtype).removeprefix("torch."),
            "start": self.start,
            "end": self.end,
            "state": self.state,
        }

    def __repr__(self) -> str:
        return (
            f"FlightEntry(seq={self.seq}, op={self.op!r}, label={self.label!r}, "
            f"phase={self.phase!r}, step={self.step}, group={self.group!r}, state={self.state!r})"
        )


@dataclass(slots=True)
class _GroupInfo:
    name: str
    ranks: tuple[int, ...]
    next_seq: int = 0


class FlightRecorder:
    """A ring of the last ``capacity`` collectives of this process.

    See [Note: Flight recorder cost] and [Note: Sequence numbers]. ``capacity``
    0 records nothing (:meth:`issue` returns ``None``).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise CommError(
                f"flight recorder capacity must be >= 0, got {capacity}; "
                f"set {_ENV} to a number of entries, or 0 to turn the recorder off"
            )
        self.capacity = capacity
        # The step new entries name (See [Note: Which step a record names]); the two below
        # decide it.
        self.step = 0
        self._runtime_step = 0
        self._training_step: int | None = None
        self._ring: list[FlightEntry | None] = [None] * capacity
        self._count = 0
        self._lock = threading.Lock()
        self._groups: dict[object, _GroupInfo] = {}
        self._world: object | None = None

    @property
    def enabled(self) -> bool:
        """Whether collectives are recorded (capacity above 0)."""
        return self.capacity > 0

    def _group_info(self, group: dist.ProcessGroup | None) -> _GroupInfo:
        key: object = group
        info = self._groups.get(key)
        if info is not None:
            return info
        world = dist.group.WORLD if dist.is_initialized() else None
        if world is not self._world:  # See [Note: Sequence numbers]
            self._world = world
            self._groups.clear()
            self._ring = [None] * self.capacity
            self._count = 0
        pg = world if group is None else group
        if pg is None:
            info = _GroupInfo("-", ())
        else:
            name = str(getattr(pg, "group_name", "")) or "?"
            info = _GroupInfo(name, tuple(dist.get_process_group_ranks(pg)))
        self._groups[key] = info
        return info

    def issue(
        self,
        op: str,
        label: str | None,
        phase: str | None,
        group: dist.ProcessGroup | None,
        numel: int,
        nbytes: int,
        dtype: torch.dtype,
    ) -> FlightEntry | None:
        """Record a collective about to be issued on ``group``; ``None`` when disabled."""
        if not self.capacity:
            return None
        with self._lock:
            info = self._group_info(group)
            entry = FlightEntry(
                info.next_seq,
                op,
                label,
                phase or op.replace("_", "-"),
                self.step,
                info.name,
                info.ranks,
                numel,
                nbytes,
                dtype,
            )
            info.next_seq += 1
            self._ring[self._count % self.capacity] = entry
            self._count += 1
        return entry

    @staticmethod
    def complete(entry: FlightEntry | None) -> None:
        """Mark ``entry`` completed (its result is in place)."""
        if entry is not None and entry.state == "issued":
            entry.end = time.time()
            entry.state = "completed"

    @staticmethod
    def fail(entry: FlightEntry | None) -> None:
        """Mark ``entry`` failed (the backend raised or timed out)."""
        if entry is not None:
            entry.end = time.time()
            entry.state = "failed"

    def entries(self) -> list[FlightEntry]:
        """The recorded entries, oldest first."""
        with self._lock:
            count, cap = self._count, self.capacity
            if not cap:
                return []
            if count <= cap:
                ring = self._ring[:count]
            else:
                start = count % cap
                ring = self._ring[start:] + self._ring[:start]
        return [entry for entry in ring if entry is not None]

    def summary(self, recent: int = 64) -> dict[str, Any]:
        """Last issued, last completed and the ``recent`` last entries, as JSON-ready values."""
        entries = self.entries()
        completed = [entry for entry in entries if entry.state == "completed"]
        return {
            "step": self.step,
            "count": self._count,
            "issued": entries[-1].as_dict() if entries else None,
            "completed": completed[-1].as_dict() if completed else None,
            "recent": [entry.as_dict() for entry in entries[-recent:]],
        }

    def set_runtime_step(self, step: int) -> None:
        """The runtime's count of completed backwards; named unless the loop names its step."""
        self._runtime_step = step
        if self._training_step is None:
            self.step = step

    def set_training_step(self, step: int | None) -> None:
        """The loop's step, named from now on; ``None`` goes back to the runtime's count."""
        self._training_step = step
        self.step = self._runtime_step if step is None else step

    def clear(self) -> None:
        """Forget every entry and sequence number."""
        with self._lock:
            self._ring = [None] * self.capacity
            self._count = 0
            self._groups.clear()
            self._world = None


def _capacity_from_env() -> int:
    raw = os.environ.get(_ENV, "").strip()
    if not raw:
        return DEFAULT_CAPACITY
    try:
        return int(raw)
    except ValueError:
        raise CommError(
            f"{_ENV}={raw!r} is not a number of entries; set it to an integer "
            f"(0 turns the flight recorder off, the default keeps {DEFAULT_CAPACITY})"
        ) from None


_RECORDER: FlightRecorder | None = None


def flight_recorder() -> FlightRecorder:
    """This process's recorder, created on first use from ``SHARD_FLIGHT_RECORDER``."""
    global _RECORDER
    recorder = _RECORDER
    if recorder is None:
        recorder = _RECORDER = FlightRecorder(_capacity_from_env())
    return recorder


def reset_flight_recorder(capacity: int | None = None) -> FlightRecorder:
    """Replace the recorder by an empty one (``capacity`` None: from the environment again)."""
    global _RECORDER
    _RECORDER = FlightRecorder(_capacity_from_env() if capacity is None else capacity)
    return _RECORDER


def set_flight_step(step: int) -> None:
    """The runtime's step count for the next collectives (the runtime's root sets it).

    Ignored while the training loop names its steps (:func:`set_training_step`).
    """
    flight_recorder().set_runtime_step(step)


def set_training_step(step: int | None) -> None:
    """Name the collectives that follow by ``step``, the step your training loop shows.

    Failure messages then say "step 5" where the loop printed step 5, after a
    resume too. ``None`` returns to the runtime's count of completed
    backwards (0 in the first iteration). See [Note: Which step a record names].
    """
    flight_recorder().set_training_step(step)
