"""Counts of the collectives shard issues: calls and bytes per kind, per label.

The runtime's tests prove communication properties by counting ("one
all-gather per unit per forward", "world size 1 makes no collective call at
all"), and benchmarks report bytes moved; both read these counters. Only
collectives that really reach ``torch.distributed`` are counted, so a world
of size 1, which short-cuts every collective into a local copy, counts
nothing.

Every collective also opens a profiler range ``shard::<kind> (<label>)`` and,
when the environment variable ``SHARD_DEBUG`` is set (to anything but ``""``
or ``"0"``), writes one debug line to the ``shard.comms`` logger.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from shard_core.errors import CommError

__all__ = [
    "COLLECTIVE_KINDS",
    "CollectiveKind",
    "CollectiveStats",
    "CommCounts",
    "comm_counters",
    "count_collectives",
    "record_collective",
    "reset_comm_counters",
]

CollectiveKind = Literal["all_gather", "reduce_scatter", "all_reduce", "broadcast"]

COLLECTIVE_KINDS: tuple[CollectiveKind, ...] = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "broadcast",
)
"""Every kind of collective shard counts, in a fixed order."""

_LOG = logging.getLogger("shard.comms")

# [Note: What a counted byte is]
# Bytes are those of the unsharded buffer a collective works on, per rank,
# which is what algorithm bandwidth is measured against: the gathered output of
# an all-gather, the full input of a reduce-scatter, the tensor of an all-reduce
# or a broadcast. Counts are of the collectives the caller asked for: a
# reduce-scatter that runs as an all-reduce on gloo, or an all-gather that runs
# in chunks (see the notes in _collectives.py), counts once, as what it is.


@dataclass(frozen=True, slots=True)
class CollectiveStats:
    """Calls and bytes of one kind of collective.

    Attributes:
        calls: Number of collectives issued.
        bytes: Bytes of the unsharded buffers they worked on (see the package README).
    """

    calls: int = 0
    bytes: int = 0


class CommCounts:
    """Calls and bytes per collective kind, in total and per label.

    :func:`comm_counters` returns a frozen snapshot; :func:`count_collectives`
    yields one that fills up while its block runs.
    """

    __slots__ = ("_by_label", "_totals")

    def __init__(self) -> None:
        # kind -> [calls, bytes]
        self._totals: dict[str, list[int]] = {kind: [0, 0] for kind in COLLECTIVE_KINDS}
        # (kind, label) -> [calls, bytes]
        self._by_label: dict[tuple[str, str], list[int]] = {}

    def _add(self, kind: str, label: str | None, nbytes: int) -> None:
        total = self._totals[kind]
        total[0] += 1
        total[1] += nbytes
        if label is not None:
            entry = self._by_label.get((kind, label))
            if entry is None:
                self._by_label[(kind, label)] = [1, nbytes]
            else:
                entry[0] += 1
                entry[1] += nbytes

    def _copy(self) -> CommCounts:
        copy = CommCounts()
        copy._totals = {kind: list(value) for kind, value in self._totals.items()}
        copy._by_label = {key: list(value) for key, value in self._by_label.items()}
        return copy

    def stats(self, kind: CollectiveKind, label: str | None = None) -> CollectiveStats:
        """Calls and bytes of ``kind``; of the collectives labelled ``label`` only when given."""
        _check_kind(kind)
        if label is None:
            calls, nbytes = self._totals[kind]
        else:
            calls, nbytes = self._by_label.get((kind, label), (0, 0))
        return CollectiveStats(calls=calls, bytes=nbytes)

    def calls(self, kind: CollectiveKind | None = None, label: str | None = None) -> int:
        """Number of collectives of ``kind`` (every kind when ``None``), optionally of one label."""
        kinds = COLLECTIVE_KINDS if kind is None else (kind,)
        return sum(self.stats(k, label).calls for k in kinds)

    def bytes(self, kind: CollectiveKind | None = None, label: str | None = None) -> int:
        """Bytes of collectives of ``kind`` (every kind when ``None``), optionally of one label."""
        kinds = COLLECTIVE_KINDS if kind is None else (kind,)
        return sum(self.stats(k, label).bytes for k in kinds)

    def labels(self) -> frozenset[str]:
        """Every label some counted collective carried."""
        return frozenset(label for _, label in self._by_label)

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{kind: {"calls": ..., "bytes": ...}}`` for every kind, for JSON reports."""
        return {kind: {"calls": c, "bytes": b} for kind, (c, b) in self._totals.items()}

    def by_label(self) -> Mapping[str, Mapping[str, CollectiveStats]]:
        """``{label: {kind: stats}}`` for every labelled collective counted."""
        result: dict[str, dict[str, CollectiveStats]] = {}
        for (kind, label), (c, b) in sorted(self._by_label.items()):
            result.setdefault(label, {})[kind] = CollectiveStats(calls=c, bytes=b)
        return result

    def __repr__(self) -> str:
        parts = ", ".join(f"{kind}={c}/{b}B" for kind, (c, b) in self._totals.items() if c or b)
        return f"CommCounts({parts})"


def _check_kind(kind: str) -> None:
    if kind not in COLLECTIVE_KINDS:
        raise CommError(
            f"unknown collective kind {kind!r}; the kinds counted are {', '.join(COLLECTIVE_KINDS)}"
        )


_LOCK = threading.Lock()
_GLOBAL = CommCounts()
_ACTIVE: list[CommCounts] = []


def record_collective(
    kind: CollectiveKind, nbytes: int, label: str | None, group_size: int
) -> None:
    """Count one collective of ``kind`` over ``nbytes`` (called by every collective of shard)."""
    with _LOCK:
        _GLOBAL._add(kind, label, nbytes)
        for counts in _ACTIVE:
            counts._add(kind, label, nbytes)
    if _LOG.isEnabledFor(logging.DEBUG) and os.environ.get("SHARD_DEBUG", "") not in ("", "0"):
        _LOG.debug("shard::%s (%s) bytes=%d group_size=%d", kind, label or "-", nbytes, group_size)


def comm_counters() -> CommCounts:
    """A snapshot of everything counted since the process started or the last reset."""
    with _LOCK:
        return _GLOBAL._copy()


def reset_comm_counters() -> None:
    """Zero the process-wide counters (open :func:`count_collectives` blocks keep theirs)."""
    global _GLOBAL
    with _LOCK:
        _GLOBAL = CommCounts()


@contextmanager
def count_collectives() -> Iterator[CommCounts]:
    """Count the collectives issued inside the ``with`` block (nested blocks each count theirs)."""
    counts = CommCounts()
    with _LOCK:
        _ACTIVE.append(counts)
    try:
        yield counts
    finally:
        with _LOCK:
            _ACTIVE.remove(counts)
