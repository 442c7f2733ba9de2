"""Fuzz shard against PyTorch's FSDP for N minutes and report every discrepancy.

    python tools/fuzz/run.py --minutes 10 --report fuzz.md [--seed 0] [--world-sizes 2,3,4]

Hypothesis draws configurations (``shard_testing.differential.config_strategy``)
in rounds of a few dozen; each runs under both libraries on a persistent
``RankPool``. Every configuration that differs is recorded and the run goes
on. The first configuration of a new kind of failure (its ``signature``:
front end, what differs, who raised what) that no known bug explains
(``KNOWN_BUGS``) is shrunk by hypothesis to a minimal one of the same kind
that no known bug explains either, whose standalone script goes into the
report; later instances of a kind are only counted and listed. Ranks that crash or
hang are recorded as ``crash`` findings without shrinking (each attempt
would cost a collective timeout).

The report is Markdown at ``--report`` and JSON beside it (``.json``):
configurations tried, outcomes, per-dimension counts (tried / differing),
and every finding with its script. See tools/fuzz/README.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed

from shard_testing import RankFailure, RankPool, RankTimeout
from shard_testing.differential import (
    Config,
    config_strategy,
    first_discrepancy,
    known_bugs_in,
    run_config,
    signature,
)

ROUND = 25  # configurations per hypothesis round; the clock is checked between rounds too
SHRINK_SECONDS = 120.0  # at most this long shrinking one new kind of failure
RUN_TIMEOUT_S = 120.0  # one configuration on the pool (a hang shows after the collective timeout)
COLLECTIVE_TIMEOUT_S = 20.0


class _NewKind(Exception):
    """Raised inside the hypothesis test for a failure of the kind being shrunk."""


@dataclass
class Finding:
    """Every configuration of one kind of failure, and the shrunk one."""

    signature: str
    configs: list[Config] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)  # the first instance's discrepancies
    shrunk: Config | None = None
    shrunk_lines: list[str] = field(default_factory=list)
    shrink_seconds: float = 0.0


@dataclass
class Session:
    """The state of one fuzzing run: the pool, the clock, the counts, the findings."""

    pool: RankPool
    deadline: float
    bitwise: bool = False
    tried: int = 0
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    dimensions: dict[str, collections.Counter[str]] = field(default_factory=dict)
    differing: dict[str, collections.Counter[str]] = field(default_factory=dict)
    findings: dict[str, Finding] = field(default_factory=dict)
    cache: dict[Config, tuple[str | None, list[str]]] = field(default_factory=dict)
    target: str | None = None  # the signature being shrunk
    shrink_until: float = 0.0
    last_raised: Config | None = None

    def evaluate(self, config: Config) -> tuple[str | None, list[str]]:
        """Run ``config`` once (cached): its signature (``None``: no discrepancy) and lines."""
        if config in self.cache:
            return self.cache[config]
        try:
            outcomes = run_config(self.pool, config, bitwise=self.bitwise, timeout=RUN_TIMEOUT_S)
        except (RankFailure, RankTimeout) as exc:
            result: tuple[str | None, list[str]] = (
                f"{config.front_end}: crash ({type(exc).__name__})",
                str(exc).splitlines()[:40],
            )
            status = "crash"
        else:
            first = first_discrepancy(outcomes)
            status = "differs" if first is not None else outcomes[0].status
            lines = [line for outcome in outcomes for line in outcome.report().splitlines()]
            result = (None if first is None else signature(config.front_end, first), lines)
        self.cache[config] = result
        if self.target is None:  # generating, not shrinking: count it
            self._count(config, status, result[0])
        return result

    def _count(self, config: Config, status: str, kind: str | None) -> None:
        self.tried += 1
        self.statuses[status] += 1
        for dimension, value in config.dimensions().items():
            self.dimensions.setdefault(dimension, collections.Counter())[value] += 1
            if kind is not None:
                self.differing.setdefault(dimension, collections.Counter())[value] += 1
        if kind is not None:
            finding = self.findings.setdefault(kind, Finding(kind))
            finding.configs.append(config)
            if not finding.lines:
                finding.lines = self.cache[config][1]

    def check(self, config: Config) -> None:
        """The body of the hypothesis test: raise only for the kind being shrunk."""
        now = time.monotonic()
        if self.target is None and now > self.deadline:
            return  # time is up: let the round run out without work
        if self.target is not None and now > self.shrink_until and config not in self.cache:
            return  # shrinking took long enough: only replay what is known
        kind, _ = self.evaluate(config)
        if kind is None or kind.endswith("(RankFailure)") or kind.endswith("(RankTimeout)"):
            return
        if known_bugs_in(config):
            return  # explained already: counted, never shrunk (nor shrunk towards)
        if self.target is None:
            if self.findings[kind].shrunk is not None:
                return  # a kind already shrunk: counted, nothing more
            self.target = kind
            self.shrink_until = time.monotonic() + SHRINK_SECONDS
        if kind == self.target:
            self.last_raised = config
            raise _NewKind(kind)


def fuzz(
    minutes: float,
    seed: int,
    world_sizes: Sequence[int],
    *,
    shrink: bool = True,
    bitwise: bool = False,
) -> Session:
    """Draw and compare configurations for ``minutes``; see the module doc."""
    start = time.monotonic()
    with RankPool(timeout=RUN_TIMEOUT_S, collective_timeout=COLLECTIVE_TIMEOUT_S) as pool:
        session = Session(pool=pool, deadline=start + 60.0 * minutes, bitwise=bitwise)
        phases = (Phase.generate, Phase.shrink) if shrink else (Phase.generate,)
        round_index = 0
        while time.monotonic() < session.deadline:
            round_index += 1

            @settings(
                max_examples=ROUND,
                deadline=None,
                database=None,
                phases=phases,
                derandomize=False,
                report_multiple_bugs=False,
                suppress_health_check=list(HealthCheck),
                verbosity=Verbosity.quiet,
            )
            @hypothesis_seed(seed * 100_003 + round_index)
            @given(config_strategy(world_sizes))
            def one_round(config: Config) -> None:
                session.check(config)

            began = time.monotonic()
            try:
                one_round()
            except _NewKind as exc:
                kind = str(exc)
                finding = session.findings[kind]
                finding.shrunk = session.last_raised
                if finding.shrunk is not None:
                    finding.shrunk_lines = session.cache[finding.shrunk][1]
                finding.shrink_seconds = time.monotonic() - began
                print(f"[fuzz] new kind of discrepancy: {kind}", flush=True)
            except Exception as exc:  # hypothesis's own complaints (a flaky replay, say)
                print(f"[fuzz] round {round_index} ended early: {exc!r}", flush=True)
            finally:
                session.target = None
            print(
                f"[fuzz] {session.tried} configurations, {len(session.findings)} kinds of "
                f"discrepancy, {max(0.0, session.deadline - time.monotonic()):.0f} s left",
                flush=True,
            )
    return session


def report(
    session: Session, *, minutes: float, seed: int, world_sizes: Sequence[int]
) -> dict[str, Any]:
    """The JSON report (Markdown is rendered from it)."""
    return {
        "minutes": minutes,
        "bitwise": session.bitwise,
        "seed": seed,
        "world_sizes": list(world_sizes),
        "configurations": session.tried,
        "statuses": dict(session.statuses.most_common()),
        "dimensions": {
            dimension: {
                value: {
                    "tried": count,
                    "differing": session.differing.get(dimension, collections.Counter())[value],
                }
                for value, count in sorted(counts.items())
            }
            for dimension, counts in sorted(session.dimensions.items())
        },
        "findings": [
            {
                "signature": finding.signature,
                "count": len(finding.configs),
                "known_bugs": sorted({bug for c in finding.configs for bug in known_bugs_in(c)}),
                "unexplained": sum(1 for c in finding.configs if not known_bugs_in(c)),
                "first_discrepancies": finding.lines,
                "shrunk": None if finding.shrunk is None else finding.shrunk.brief(),
                "shrunk_discrepancies": finding.shrunk_lines,
                "shrink_seconds": round(finding.shrink_seconds, 1),
                "script": None if finding.shrunk is None else finding.shrunk.to_script(),
                "configs": [c.brief() for c in finding.configs],
            }
            for finding in sorted(
                session.findings.values(),
                key=lambda f: (-sum(1 for c in f.configs if not known_bugs_in(c)), -len(f.configs)),
            )
        ],
    }


def markdown(data: dict[str, Any]) -> str:
    """The report for people: summary, dimension table, one section per kind of failure."""
    lines = [
        "# Differential fuzzing: shard vs PyTorch FSDP",
        "",
        f"{data['configurations']} configurations in {data['minutes']} min "
        f"(seed {data['seed']}, world sizes {data['world_sizes']}).",
        "",
        "Outcomes: " + ", ".join(f"{k}: {v}" for k, v in data["statuses"].items()),
        "",
        "## Dimensions (tried / differing)",
        "",
        "| dimension | values |",
        "|---|---|",
    ]
    for dimension, values in data["dimensions"].items():
        cells = ", ".join(f"{v} {c['tried']}/{c['differing']}" for v, c in values.items())
        lines.append(f"| {dimension} | {cells} |")
    lines += ["", f"## Findings ({len(data['findings'])} kinds)", ""]
    for index, finding in enumerate(data["findings"], 1):
        known = ", ".join(finding["known_bugs"]) or "none"
        lines += [
            f"### {index}. {finding['signature']} ({finding['count']} configurations)",
            "",
            f"Explained by no known bug: {finding['unexplained']} of {finding['count']}. "
            f"Known bugs among them: {known}.",
            "",
            "First instance:",
            "",
            "```",
            *finding["first_discrepancies"][:12],
            "```",
            "",
        ]
        if finding["shrunk"] is not None:
            lines += [
                f"Shrunk ({finding['shrink_seconds']} s) to `{finding['shrunk']}`:",
                "",
                "```",
                *finding["shrunk_discrepancies"][:12],
                "```",
                "",
                "<details><summary>standalone script</summary>",
                "",
                "```python",
                finding["script"].rstrip("\n"),
                "```",
                "",
                "</details>",
                "",
            ]
        lines += ["Configurations:", ""]
        lines += [f"- `{c}`" for c in finding["configs"][:10]]  # reprs: paste into Python
        if finding["count"] > 10:
            lines.append(f"- ... {finding['count'] - 10} more in the JSON report")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, fuzz, write the reports; 1 when anything differed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--minutes", type=float, required=True, help="how long to draw new configurations"
    )
    parser.add_argument(
        "--report", type=Path, required=True, help="Markdown report path (JSON beside it)"
    )
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed of the first round")
    parser.add_argument(
        "--world-sizes",
        default="2,3,4",
        help="comma-separated world sizes to draw from (default: 2,3,4; 3 shards unevenly)",
    )
    parser.add_argument("--no-shrink", action="store_true", help="record failures unshrunk")
    parser.add_argument(
        "--bitwise",
        action="store_true",
        help="compare mixed-precision runs bitwise too (default: within bf16 rounding)",
    )
    args = parser.parse_args(argv)
    world_sizes = [int(part) for part in args.world_sizes.split(",") if part.strip()]
    if not world_sizes or any(size < 1 for size in world_sizes):
        parser.error(f"--world-sizes must list positive integers, got {args.world_sizes!r}")
    session = fuzz(
        args.minutes, args.seed, world_sizes, shrink=not args.no_shrink, bitwise=args.bitwise
    )
    data = report(session, minutes=args.minutes, seed=args.seed, world_sizes=world_sizes)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(markdown(data), encoding="utf-8")
    args.report.with_suffix(".json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    print(
        f"[fuzz] {data['configurations']} configurations, {len(data['findings'])} kinds of "
        f"discrepancy; report: {args.report}",
        flush=True,
    )
    return 1 if data["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
