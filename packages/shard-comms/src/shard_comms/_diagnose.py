"""Named failures: turn a backend's collective error into one that says what happened.

When a collective fails or times out (gloo raises ``RuntimeError``: a
timeout, a peer that closed its connection), :func:`collective_failure`
builds a :class:`~shard_core.errors.CollectiveError` from every rank's flight
recorder (see ``_flight.py``). It names, in order: this rank with its last
issued and last completed collective; what every other rank that answers
last issued and completed; the first rank whose record differs and how; the
ranks that are behind (when no record differs); the ranks that did not
answer.

[Note: Exchanging records through the store]
A failed collective cannot carry the records (the group is what broke), but
the c10d store still works: it is a separate TCP server (torchrun's agent
hosts it, outside the ranks), and a rank killed with SIGKILL does not take it
down. So a failing rank writes a compact summary of its record (last issued,
last completed, the 64 most recent entries) under ``shard/flight/<rank>`` in
the default group's store, then polls its peers' keys with ``check`` (which
never blocks) for ``SHARD_FLIGHT_WAIT`` seconds (5 by default). Every live
rank of a broken group fails within the group's timeout, so their keys appear
within that time of each other; a rank whose key is still missing is dead, or
stuck outside any collective (a ``time.sleep``, an endless loop). Only the
first failure of a process waits: the ones that follow (a step's cleanup
waiting on the same broken group) read what is there and go on.

[Note: A launcher's SIGTERM during the exchange]
When a rank dies, an elastic launcher (torchrun, ``shard train``) terminates
the others within its monitor interval, usually before they have read their
peers' records. Where :func:`~shard_comms.init_distributed` installed its
SIGTERM handler (``_terminate.py``, [Note: SIGTERM from a launcher]), a
SIGTERM during the exchange cuts the wait to ``SHARD_SIGTERM_GRACE_S``
seconds from the signal; the finished message is then written to stderr and
the rank ends by SIGTERM, as the launcher asked. A SIGTERM that comes before
any collective has failed gets the same exchange from the handler
(:func:`termination_report`), and one that comes after a failure was raised
writes that failure again, so the console has it whichever came first.

[Note: Where a dead rank was]
A rank that died cannot publish its record, but the survivors' records say
where it was: a collective completes on one rank only once every rank of its
group has taken part, so the last collective this rank completed on a group
that holds the dead rank is the last one the dead rank reached (its phase
and step), and the one this rank is waiting in (or would issue next) is the
one it never reached. The message names both.

``SHARD_FLIGHT_RECORDER_DUMP=DIR`` also writes every failing rank's whole
record to ``DIR/flight_rank<r>.json``; ``shard debug flight DIR`` prints them
side by side (:func:`format_flight_table`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

from shard_comms import _terminate
from shard_comms._flight import FlightEntry, FlightRecorder, flight_recorder
from shard_core.errors import CollectiveError, CommError

__all__ = [
    "collective_failure",
    "describe_entry",
    "find_divergence",
    "format_flight_table",
    "load_flight_dump",
    "termination_report",
]

_LOG = logging.getLogger("shard.comms")
_KEY = "shard/flight/{rank}"
_WAIT_ENV = "SHARD_FLIGHT_WAIT"
_DUMP_ENV = "SHARD_FLIGHT_RECORDER_DUMP"
_DEFAULT_WAIT_S = 5.0
_POLL_S = 0.05
_reported = False
_UNRECORDED = "a collective outside the flight record (a checkpoint save's, say)"
# The message of this process's first collective failure, for a SIGTERM that comes after it.
_last_failure: str | None = None


def _wait_seconds() -> float:
    raw = os.environ.get(_WAIT_ENV, "").strip()
    if not raw:
        return _DEFAULT_WAIT_S
    try:
        return max(0.0, float(raw))
    except ValueError:
        raise CommError(
            f"{_WAIT_ENV}={raw!r} is not a number of seconds; set it to e.g. 5"
        ) from None


def describe_entry(entry: Mapping[str, Any] | None) -> str:
    """``all-gather of `layers.1` (forward all-gather, step 2, seq 17)``, or ``nothing``."""
    if entry is None:
        return "nothing"
    op = str(entry["op"]).replace("_", "-")
    return (
        f"{op} of `{entry['label'] or '-'}` ({entry['phase']}, step {entry['step']}, "
        f"seq {entry['seq']})"
    )


def _short(entry: Mapping[str, Any]) -> str:
    return f"`{entry['label'] or '-'}` ({entry['phase']}, step {entry['step']}, seq {entry['seq']})"


def _signature(entry: Mapping[str, Any]) -> tuple[Any, ...]:
    return (entry["op"], entry["label"], entry["phase"], entry["numel"], entry["dtype"])


def find_divergence(summaries: Mapping[int, Mapping[str, Any]]) -> str | None:
    """The first collective, by sequence number in its group, where two ranks' records differ.

    ``summaries`` maps a rank to its recorder's summary. Returns a sentence
    naming the rank that differs from the lowest rank holding that entry, or
    ``None`` when every entry both hold agrees.
    """
    by_group: dict[str, dict[int, dict[int, Mapping[str, Any]]]] = {}
    for rank, summary in summaries.items():
        for entry in summary.get("recent", []):
            by_group.setdefault(entry["group"], {}).setdefault(rank, {})[entry["seq"]] = entry
    found: list[tuple[float, str]] = []
    for ranks in by_group.values():
        if len(ranks) < 2:
            continue
        seqs = sorted({seq for entries in ranks.values() for seq in entries})
        for seq in seqs:
            holders = sorted(rank for rank, entries in ranks.items() if seq in entries)
            if len(holders) < 2:
                continue
            ref_rank = holders[0]
            ref = ranks[ref_rank][seq]
            other = next(
                (r for r in holders[1:] if _signature(ranks[r][seq]) != _signature(ref)), None
            )
            if other is None:
                continue
            mine = ranks[other][seq]
            what = describe_entry(mine)
            if mine["op"] == ref["op"] and mine["label"] != ref["label"]:
                where = f"rank {ref_rank} issued `{ref['label'] or '-'}`"
            elif _signature(mine)[:3] == _signature(ref)[:3]:
                where = (
                    f"rank {ref_rank} issued {describe_entry(ref)} "
                    f"({ref['numel']} {ref['dtype']} elements, rank {other} "
                    f"{mine['numel']} {mine['dtype']})"
                )
            else:
                where = f"rank {ref_rank} issued {describe_entry(ref)}"
            found.append((float(ref["start"]), f"rank {other} issued the {what} where {where}"))
            break
    if not found:
        return None
    return min(found)[1]


def _behind(summaries: Mapping[int, Mapping[str, Any]]) -> list[str]:
    last: dict[str, dict[int, Mapping[str, Any]]] = {}
    for rank, summary in summaries.items():
        for entry in summary.get("recent", []):
            seen = last.setdefault(entry["group"], {}).get(rank)
            if seen is None or entry["seq"] > seen["seq"]:
                last[entry["group"]][rank] = entry
    lines: list[str] = []
    for group, ranks in sorted(last.items()):
        if len(ranks) < 2:
            continue
        top = max(entry["seq"] for entry in ranks.values())
        ahead = min(rank for rank, entry in ranks.items() if entry["seq"] == top)
        for rank, entry in sorted(ranks.items()):
            if entry["seq"] < top:
                lines.append(
                    f"rank {rank} is behind on group {group}: it last issued "
                    f"{describe_entry(entry)}, rank {ahead} is at {_short(ranks[ahead])}"
                )
    return lines


def _rank_line(rank: int, summary: Mapping[str, Any], me: bool) -> str:
    who = f"rank {rank} (this rank)" if me else f"rank {rank}"
    issued = summary.get("issued")
    state = f" [{issued['state']}]" if issued is not None else ""
    return (
        f"{who}: last issued {describe_entry(issued)}{state}; "
        f"last completed {describe_entry(summary.get('completed'))}"
    )


def _default_store() -> Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no default group, or it is being torn down
        return None


@dataclass(slots=True)
class _Exchange:
    """What one exchange of records found."""

    answered: dict[int, dict[str, Any]] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)
    problem: str | None = None  # why the store could not be used
    waited: float = 0.0  # seconds spent waiting for the missing ranks


def _publish_and_gather(
    store: Store | None, rank: int, peers: Sequence[int], payload: dict[str, Any], wait: float
) -> _Exchange:
    """Write this rank's summary, read the peers' for up to ``wait`` seconds.

    See [Note: Exchanging records through the store]; a SIGTERM shortens the
    wait (see [Note: A launcher's SIGTERM during the exchange]).
    """
    if not peers:
        return _Exchange()
    if store is None:
        return _Exchange(missing=list(peers), problem="no c10d store to exchange records through")
    try:
        store.set(_KEY.format(rank=rank), json.dumps(payload))
    except Exception as exc:
        return _Exchange(missing=list(peers), problem=f"the c10d store did not answer ({exc})")
    found = _Exchange(missing=list(peers))
    began = time.monotonic()
    deadline = began + wait
    while True:
        for peer in list(found.missing):
            key = _KEY.format(rank=peer)
            try:
                if not store.check([key]):
                    continue
                found.answered[peer] = json.loads(store.get(key))
            except Exception as exc:
                found.problem = f"the c10d store stopped answering ({exc})"
                return found
            found.missing.remove(peer)
        now = time.monotonic()
        found.waited = now - began
        if not found.missing or now >= _terminate.exchange_deadline(deadline):
            return found
        time.sleep(_POLL_S)


def _dump(rank: int, payload: Mapping[str, Any]) -> str | None:
    directory = os.environ.get(_DUMP_ENV, "").strip()
    if not directory:
        return None
    path = Path(directory) / f"flight_rank{rank}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        full = dict(payload)
        full["entries"] = [entry.as_dict() for entry in flight_recorder().entries()]
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(full, indent=1))
        tmp.replace(path)
    except OSError as exc:
        return f"could not write the flight record to {path}: {exc}"
    return str(path)


def collective_failure(entry: FlightEntry | None, error: BaseException) -> CollectiveError:
    """The named failure for ``entry``, which the backend failed with ``error``.

    ``entry`` ``None``: a collective the recorder does not see (``torch.distributed``
    called directly, as a checkpoint save does) failed with ``error``; the
    message then names what every rank last did in shard's collectives, and
    which ranks are gone.

    Marks the entry failed, exchanges records with the peers (see [Note:
    Exchanging records through the store]) and returns the exception to
    raise; the caller raises it ``from error``. Whatever goes wrong while
    reading the records, the backend's error is still reported.
    """
    try:
        return _diagnose(entry, error)
    except Exception as problem:
        FlightRecorder.fail(entry)
        return CollectiveError(
            f"collective failed: {describe_entry(entry.as_dict() if entry else None)} raised "
            f"{type(error).__name__}: {error}\n  (the flight records could not be compared: "
            f"{type(problem).__name__}: {problem})"
        )


def _diagnose(entry: FlightEntry | None, error: BaseException) -> CollectiveError:
    global _reported, _last_failure
    recorder = flight_recorder()
    recorder.fail(entry)
    initialized = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialized else 0
    world = dist.get_world_size() if initialized else 1
    group_ranks = list(entry.ranks) if entry is not None and entry.ranks else list(range(world))
    peers = [r for r in group_ranks if r != rank]
    reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}"
    payload: dict[str, Any] = {"rank": rank, "time": time.time(), "reason": reason}
    payload.update(recorder.summary())
    failed = entry.as_dict() if entry is not None else None
    payload["failed"] = failed
    store = _default_store() if initialized else None
    wait = 0.0 if _reported else _wait_seconds()
    _reported = True
    # Said at once: a launcher may stop this rank before the peers' records arrive.
    _LOG.error(
        "shard: rank %d: %s raised %s; reading the other ranks' flight records (up to %g s)",
        rank,
        describe_entry(failed),
        reason,
        wait,
    )
    # See [Note: A launcher's SIGTERM during the exchange].
    with _terminate.exchanging():
        found = _publish_and_gather(store, rank, peers, payload, wait)
        dumped = _dump(rank, payload)
        # No entry: a collective shard does not record (a checkpoint's) failed.
        what = describe_entry(failed) if failed is not None else _UNRECORDED
        lines = [f"collective failed on rank {rank} of {world}: {what} raised {reason}"]
        if not recorder.enabled:
            lines.append(
                "the flight recorder is off (SHARD_FLIGHT_RECORDER=0): no record to compare"
            )
        lines.extend(_findings(rank, payload, found, f"after up to {wait:g} s ({_WAIT_ENV})"))
        if dumped is not None:
            lines.append(f"flight record written to {dumped}")
        lines.append(_fix(rank, payload, found))
        failure = CollectiveError("\n  ".join(lines))
        _last_failure = str(failure)
    # A SIGTERM from here on runs the handler, which writes _last_failure and ends the rank.
    if _terminate.terminated():
        stopped = f"shard: rank {rank} of {world} was stopped by SIGTERM:"
        _terminate.write_console(f"{stopped}\n{failure}")
        _terminate.end_as_asked()
    return failure


def termination_report(deadline: float) -> str | None:
    """What a rank stopped by SIGTERM says, exchanging records until ``deadline`` (monotonic).

    ``None`` when there is nothing to say: every rank answered and no record
    differs (the whole job is being stopped). After a collective failure,
    that failure again. See [Note: SIGTERM from a launcher] in ``_terminate.py``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    if _last_failure is not None:
        return f"shard: rank {rank} of {world} was stopped by SIGTERM after:\n{_last_failure}"
    recorder = flight_recorder()
    payload: dict[str, Any] = {
        "rank": rank,
        "time": time.time(),
        "reason": "stopped by SIGTERM",
        "failed": None,
    }
    payload.update(recorder.summary())
    peers = [r for r in range(world) if r != rank]
    wait = max(0.0, deadline - time.monotonic())
    found = _publish_and_gather(_default_store(), rank, peers, payload, wait)
    everyone = {rank: payload, **found.answered}
    if not found.missing and found.problem is None and find_divergence(everyone) is None:
        return None
    dumped = _dump(rank, payload)
    grace = f"after up to {_terminate.grace_seconds():g} s ({_terminate.GRACE_ENV})"
    lines = [
        f"shard: rank {rank} of {world} was stopped by SIGTERM (its launcher ending the job) "
        f"during step {payload['step']}; its last collective: "
        f"{_with_state(payload.get('issued'))}"
    ]
    lines.extend(_findings(rank, payload, found, grace))
    if dumped is not None:
        lines.append(f"flight record written to {dumped}")
    lines.append(_fix(rank, payload, found))
    return "\n  ".join(lines)


def _with_state(entry: Mapping[str, Any] | None) -> str:
    return describe_entry(entry) + (f" [{entry['state']}]" if entry is not None else "")


def _findings(rank: int, payload: dict[str, Any], found: _Exchange, waited: str) -> list[str]:
    """The lines every report shares: each rank's last collectives, the difference, the missing."""
    lines = [_rank_line(rank, payload, me=True)]
    for peer in sorted(found.answered):
        lines.append(_rank_line(peer, found.answered[peer], me=False))
    everyone = {rank: payload, **found.answered}
    divergence = find_divergence(everyone)
    if divergence is not None:
        lines.append(f"first difference: {divergence}")
    else:  # after a difference, who is ahead is only its fallout
        lines.extend(_behind(everyone))
    if found.missing:
        names = ", ".join(str(r) for r in found.missing)
        lines.append(
            f"did not answer: rank {names} (dead, or stuck outside a collective; no record "
            f"in the c10d store {waited})"
        )
        entries = flight_recorder().entries()
        lines.extend(_last_seen(peer, entries) for peer in found.missing)
    if found.problem is not None:
        lines.append(found.problem)
    return lines


def _last_seen(peer: int, entries: Sequence[FlightEntry]) -> str:
    """Where ``peer`` was when it stopped answering; see [Note: Where a dead rank was]."""
    shared = [e for e in entries if peer in e.ranks]
    done = [i for i, e in enumerate(shared) if e.state == "completed"]
    if not done:
        return f"rank {peer} completed no recorded collective with this rank"
    last = shared[done[-1]]
    line = (
        f"rank {peer} was last seen in the {describe_entry(last.as_dict())}, the last "
        "collective it completed with this rank"
    )
    after = next((e for e in shared[done[-1] + 1 :] if e.state != "completed"), None)
    if after is not None:
        line += f"; it did not complete the {describe_entry(after.as_dict())}"
    return line


def _fix(rank: int, payload: Mapping[str, Any], found: _Exchange) -> str:
    """The advice: a rank that diverged is a bug in the program; a missing one, a lost rank."""
    more = f"set {_DUMP_ENV}=DIR and run `shard debug flight DIR` for the full record"
    if found.missing and find_divergence({rank: payload, **found.answered}) is None:
        names = ", ".join(str(r) for r in found.missing)
        return (
            f"fix: find out what ended rank {names} (its own output; the launcher's exit code "
            f"for it: SIGKILL is often the out-of-memory killer); {more}"
        )
    return (
        "fix: make every rank run the same modules in the same order each step (no "
        "rank-dependent control flow around sharded modules), and check the named rank's log; "
        f"{more}"
    )


def load_flight_dump(directory: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """Every ``flight_rank<r>.json`` in ``directory``, by rank.

    Raises:
        CommError: the directory holds no flight record.
    """
    path = Path(directory)
    records: dict[int, dict[str, Any]] = {}
    for file in sorted(path.glob("flight_rank*.json")):
        data = json.loads(file.read_text())
        records[int(data["rank"])] = data
    if not records:
        raise CommError(
            f"no flight_rank<r>.json in {path}; run the job with "
            f"{_DUMP_ENV}={path} so failing ranks write their record there"
        )
    return records


def format_flight_table(records: Mapping[int, Mapping[str, Any]], last: int = 20) -> str:
    """The per-rank table of the last ``last`` sequence numbers of each group, and a verdict."""
    out: list[str] = []
    ranks = sorted(records)
    for rank in ranks:
        rec = records[rank]
        out.append(f"rank {rank}: {rec.get('reason', '')}")
        out.append(f"  {_rank_line(rank, rec, me=False).split(': ', 1)[1]}")
    by_group: dict[str, dict[int, dict[int, Mapping[str, Any]]]] = {}
    for rank in ranks:
        rec = records[rank]
        for entry in rec.get("entries", rec.get("recent", [])):
            by_group.setdefault(entry["group"], {}).setdefault(rank, {})[entry["seq"]] = entry
    summaries = {
        rank: {"recent": list(records[rank].get("entries", records[rank].get("recent", [])))}
        for rank in ranks
    }
    width = 50
    for group, per_rank in sorted(by_group.items()):
        seqs = sorted({seq for entries in per_rank.values() for seq in entries})[-last:]
        out.append("")
        header = f"group {group}  seq  " + "".join(f"rank {r}".ljust(width) for r in ranks)
        out.append(header.rstrip())
        for seq in seqs:
            cells = []
            sigs = set()
            for rank in ranks:
                entry = per_rank.get(rank, {}).get(seq)
                if entry is None:
                    cells.append("-".ljust(width))
                    continue
                sigs.add(_signature(entry))
                cell = f"{entry['phase']} {entry['label'] or '-'} s{entry['step']} {entry['state']}"
                cells.append(cell[: width - 2].ljust(width))
            mark = "!" if len(sigs) > 1 else " "
            out.append(
                f"{mark}{' ' * (len(f'group {group}') - 1)}{seq:5d}  {''.join(cells)}".rstrip()
            )
    divergence = find_divergence(summaries)
    out.append("")
    out.append(f"first difference: {divergence}" if divergence else "no difference in the records")
    out.extend(_behind(summaries))
    missing = sorted(
        {r for rec in records.values() for entry in rec.get("entries", []) for r in entry["ranks"]}
        - set(ranks)
    )
    if missing:
        out.append(f"no record from rank {', '.join(map(str, missing))} (dead, or did not fail)")
    return "\n".join(out)
