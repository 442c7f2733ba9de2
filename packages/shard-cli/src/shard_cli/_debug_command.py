"""``shard debug flight DIR``: read the flight records a failed job dumped.

A job run with ``SHARD_FLIGHT_RECORDER_DUMP=DIR`` writes each failing rank's
flight recorder to ``DIR/flight_rank<r>.json`` (shard-comms'
``_diagnose.py``). This prints them merged: each rank's error and last
collectives, then per process group one row per sequence number with every
rank's collective side by side (``!`` marks a row where ranks disagree), then
the first difference, the ranks that are behind, and the ranks with no record.
shard-comms (and torch) are imported when the command runs, not when
``shard --help`` builds its parser (see [Note: a torch-free parser] in
``__main__.py``).
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["add_debug_parser"]


def add_debug_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``shard debug flight``."""
    p = sub.add_parser("debug", help="read what a failed job left behind")
    debug = p.add_subparsers(dest="debug_command", required=True)
    flight = debug.add_parser(
        "flight",
        help="merge the flight records SHARD_FLIGHT_RECORDER_DUMP=DIR wrote: who is behind, "
        "where the ranks diverge",
    )
    flight.add_argument("dir", help="the directory SHARD_FLIGHT_RECORDER_DUMP named")
    flight.add_argument(
        "--last", type=int, default=20, help="sequence numbers to show per group (default 20)"
    )
    flight.add_argument("--json", action="store_true", help="print the merged records as JSON")
    flight.set_defaults(run=_flight)


def _flight(args: argparse.Namespace) -> int:
    from shard_comms import format_flight_table, load_flight_dump
    from shard_core.errors import CommError

    try:
        records = load_flight_dump(args.dir)
    except (CommError, OSError, ValueError, KeyError) as exc:
        print(f"shard debug flight: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({str(rank): records[rank] for rank in sorted(records)}, indent=1))
    else:
        print(format_flight_table(records, last=max(1, args.last)))
    return 0
