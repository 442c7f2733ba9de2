"""Soak under faults: ``shard train --max-restarts`` while a random rank is killed at random times.

``soak.py --faults`` runs this. Why: a restart that resumes exactly once in
a test may still lose its way on the tenth restart, when a kill lands in a
checkpoint save, in another restart's start-up or in a survivor's report.
The soak trains the tiny preset on 2 CPU ranks for ``--minutes`` (30 by
default) under ``--max-restarts`` and, at random times (seeded), SIGKILLs a
random rank (rank 0 included); then stops the run with SIGINT (Ctrl-C),
trains the same number of steps without interruption, and compares the two
loss curves step by step. It reports the kills, the restarts, the steps
lost (trained, then trained again after the restart went back to the last
checkpoint), how many kills a survivor named (``did not answer: rank N``)
and whether the curves are equal. Exit status 0 when they are, and every
restart resumed.

[Note: what a kill costs]
A kill at step ``s`` (the last step rank 0 had logged) sends the next
attempt back to the last checkpoint, at step ``c <= s``: ``s - c`` steps
are trained twice. The soak reads ``s`` from ``metrics.jsonl`` just before
the kill and ``c`` from the restart's note ("resuming from the checkpoint
at step c"); a kill before the attempt logged anything new loses nothing.

Linux only: the ranks are found as the launcher's child processes in
``/proc`` (their ``RANK`` from ``/proc/<pid>/environ``).

Run from the repository root::

    .venv/bin/python tools/bench/soak.py --faults --minutes 30 --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_RESUMED = re.compile(
    r"restart (\d+) after a rank failed: resuming from the checkpoint at step (\d+)"
)
_STARTED_OVER = re.compile(r"restart (\d+) after a rank failed: no checkpoint of this run yet")
_NAMED = re.compile(r"did not answer: rank ([\d, ]+) ")


@dataclass(frozen=True)
class FaultConfig:
    """One fault soak: the run, the kills and how long."""

    minutes: float = 30.0
    seed: int = 0
    world_size: int = 2
    preset: str = "tiny"
    batch: int = 4
    seq: int = 32
    ckpt_every: int = 25
    # shard train --async-checkpoint: kills then also land while a save is written.
    async_checkpoint: bool = False
    # Seconds between kills: uniform in [min_interval, 2 * mean_interval - min_interval].
    mean_interval: float = 90.0
    min_interval: float = 15.0


@dataclass
class Kill:
    """One SIGKILL: when (seconds into the run), which rank, and the last step logged then."""

    at_s: float
    rank: int
    pid: int
    last_step: int


@dataclass
class FaultReport:
    """What the soak found."""

    config: dict[str, Any]
    wall_s: float = 0.0
    steps: int = 0  # the faulted run's last step (all of 1..steps logged)
    kills: list[Kill] = field(default_factory=list)
    resumed_from: list[int | None] = field(default_factory=list)  # per restart; None: step 1
    named: int = 0  # kills a survivor named
    steps_lost: list[int] = field(default_factory=list)
    equal: bool = False
    first_difference: int | None = None
    final_loss: float | None = None
    reference_final_loss: float | None = None
    problems: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- the processes


def rank_pids(launcher: int) -> dict[int, int]:
    """The launcher's rank processes, as ``{rank: pid}`` (Linux ``/proc``)."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parent = int(stat[stat.rindex(")") + 2 :].split()[1])
            if parent != launcher:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        for item in environ:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = int(entry.name)
    return found


def last_step(metrics: Path) -> int:
    """The last step in ``metrics.jsonl`` (0 when there is none yet)."""
    try:
        lines = metrics.read_text(encoding="utf-8").splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue  # a line being written
    return 0


def losses(metrics: Path) -> list[tuple[int, float]]:
    lines = metrics.read_text(encoding="utf-8").splitlines()
    return [(int(r["step"]), float(r["loss"])) for r in map(json.loads, filter(None, lines))]


def _train_command(cfg: FaultConfig, data: Path, run_dir: Path, steps: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "shard_cli",
        "train",
        "--preset",
        cfg.preset,
        "--nproc-per-node",
        str(cfg.world_size),
        "--batch",
        str(cfg.batch),
        "--seq",
        str(cfg.seq),
        "--seed",
        str(cfg.seed),
        "--steps",
        str(steps),
        "--ckpt-every",
        str(cfg.ckpt_every),
        "--sample-chars",
        "0",
        "--data",
        str(data),
        "--run-dir",
        str(run_dir),
        *(["--async-checkpoint"] if cfg.async_checkpoint else []),
    ]


# ---------------------------------------------------------------------------- analysis


def analyse(
    report: FaultReport,
    stderr: str,
    faulted: list[tuple[int, float]],
    reference: list[tuple[int, float]],
) -> FaultReport:
    """Fill ``report`` from the faulted run's stderr and both loss curves.

    See [Note: what a kill costs] for the steps lost.
    """
    restarts: dict[int, int | None] = {}
    for match in _RESUMED.finditer(stderr):
        restarts[int(match.group(1))] = int(match.group(2))
    for match in _STARTED_OVER.finditer(stderr):
        restarts[int(match.group(1))] = None
    report.resumed_from = [restarts[n] for n in sorted(restarts)]
    # The survivors' reports of kill i come before restart i+1's note.
    notes = sorted([*_RESUMED.finditer(stderr), *_STARTED_OVER.finditer(stderr)], key=_start)
    bounds = [0, *(note.start() for note in notes), len(stderr)]
    report.named = 0
    for index, kill in enumerate(report.kills):
        segment = stderr[bounds[index] : bounds[index + 1]] if index + 1 < len(bounds) else ""
        named = {
            int(r)
            for match in _NAMED.finditer(segment)
            for r in match.group(1).replace(" ", "").split(",")
            if r
        }
        report.named += kill.rank in named
    report.steps_lost = [
        max(0, kill.last_step - (resumed or 0))
        for kill, resumed in zip(report.kills, report.resumed_from, strict=False)
    ]
    if len(report.resumed_from) != len(report.kills):
        report.problems.append(
            f"{len(report.kills)} kills but {len(report.resumed_from)} restarts in the output"
        )
    steps = [step for step, _ in faulted]
    report.steps = steps[-1] if steps else 0
    if steps != list(range(1, report.steps + 1)):
        report.problems.append("the faulted run's metrics.jsonl is not steps 1..N once each")
    report.final_loss = faulted[-1][1] if faulted else None
    report.reference_final_loss = reference[-1][1] if reference else None
    report.first_difference = next(
        (a[0] for a, b in zip(faulted, reference, strict=False) if a != b), None
    )
    if report.first_difference is None and len(faulted) != len(reference):
        report.first_difference = min(len(faulted), len(reference)) + 1
    report.equal = report.first_difference is None and bool(faulted)
    return report


def _start(match: re.Match[str]) -> int:
    return match.start()


def summary_lines(report: FaultReport) -> list[str]:
    """The soak's verdict, a few lines."""
    cfg = report.config
    kills = report.kills
    by_rank = {r: sum(1 for k in kills if k.rank == r) for r in range(cfg["world_size"])}
    lost = report.steps_lost
    lines = [
        f"fault soak: preset {cfg['preset']}, {cfg['world_size']} ranks (gloo, cpu), batch "
        f"{cfg['batch']}x{cfg['seq']}, checkpoint every {cfg['ckpt_every']}"
        f"{' (async)' if cfg.get('async_checkpoint') else ''}, seed "
        f"{cfg['seed']}; {report.wall_s / 60:.1f} min of training, {report.steps} steps",
        f"kills: {len(kills)} ("
        + ", ".join(f"rank {r}: {n}" for r, n in by_rank.items())
        + f"); restarts: {len(report.resumed_from)}; named by a survivor: {report.named} of "
        f"{len(kills)}",
        f"steps lost: {sum(lost)} in all (trained again after a restart), "
        f"{(sum(lost) / len(lost)) if lost else 0:.1f} per kill, at most {max(lost, default=0)}",
    ]
    if report.equal:
        lines.append(
            f"loss curve: equal to the uninterrupted run's at every step 1-{report.steps} "
            f"(final loss {report.final_loss})"
        )
    else:
        lines.append(
            f"loss curve: differs from the uninterrupted run's from step "
            f"{report.first_difference} (final {report.final_loss} vs "
            f"{report.reference_final_loss})"
        )
    lines.extend(f"problem: {p}" for p in report.problems)
    return lines


# ---------------------------------------------------------------------------- the soak


def _wait_for_progress(
    metrics: Path, proc: subprocess.Popen[bytes], after: int, timeout: float
) -> None:
    """Until the run logs a step past ``after``, or ends, or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline and last_step(metrics) <= after:
        time.sleep(0.2)


def _wait_for_restart(
    err: Path, metrics: Path, proc: subprocess.Popen[bytes], restarts: int, timeout: float
) -> None:
    """Until the ``restarts``-th restart has said where it resumes and has trained a step.

    The next kill then hits a rank of that attempt, not a survivor of the
    last one still reporting.
    """
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        text = err.read_text(encoding="utf-8", errors="replace")
        notes = [*_RESUMED.finditer(text), *_STARTED_OVER.finditer(text)]
        if len(notes) >= restarts:
            resumed = _RESUMED.finditer(text)
            start = max(
                (int(m.group(2)) for m in resumed if int(m.group(1)) == restarts), default=0
            )
            _wait_for_progress(metrics, proc, start, deadline - time.monotonic())
            return
        time.sleep(0.2)


def run_fault_soak(cfg: FaultConfig, workdir: Path) -> FaultReport:
    """The faulted run, the kills, the uninterrupted reference, and their comparison."""
    from shard_cli._corpus import load_corpus

    data = workdir / "corpus.txt"  # fixed: the sources may change during the soak
    data.write_text(load_corpus().text, encoding="utf-8")
    faulted_dir, reference_dir = workdir / "faulted", workdir / "reference"
    report = FaultReport(config=asdict(cfg))
    rng = random.Random(cfg.seed)
    env = {k: v for k, v in os.environ.items() if k != "SHARD_TRAIN_TEST_KILL_AT_STEP"}
    command = [*_train_command(cfg, data, faulted_dir, 10**7), "--max-restarts", "100000"]
    err_path = workdir / "faulted.err"
    metrics = faulted_dir / "metrics.jsonl"
    with err_path.open("wb") as err, (workdir / "faulted.out").open("wb") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=err, start_new_session=True)
        started = time.monotonic()
        end = started + cfg.minutes * 60
        try:
            _wait_for_progress(metrics, proc, 0, 600)
            while proc.poll() is None:
                wait = rng.uniform(cfg.min_interval, 2 * cfg.mean_interval - cfg.min_interval)
                if time.monotonic() + wait >= end:
                    break
                time.sleep(wait)
                rank = rng.randrange(cfg.world_size)
                pids = rank_pids(proc.pid)
                while rank not in pids and proc.poll() is None:  # between attempts
                    time.sleep(0.5)
                    pids = rank_pids(proc.pid)
                if proc.poll() is not None:
                    break
                step = last_step(metrics)
                try:
                    os.kill(pids[rank], signal.SIGKILL)
                except ProcessLookupError:
                    continue
                report.kills.append(Kill(time.monotonic() - started, rank, pids[rank], step))
                print(
                    f"[{(time.monotonic() - started) / 60:5.1f} min] killed rank {rank} "
                    f"(pid {pids[rank]}) after step {step}",
                    flush=True,
                )
                _wait_for_restart(err_path, metrics, proc, len(report.kills), 600)
            time.sleep(max(0.0, end - time.monotonic()))
            # Stop as a user would, once the last restart trains again.
            _wait_for_progress(metrics, proc, last_step(metrics), 600)
            report.wall_s = time.monotonic() - started
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if code != 130:
        report.problems.append(f"the faulted run ended with status {code}, not 130 (Ctrl-C)")
    faulted = losses(metrics)
    steps = len(faulted)
    print(
        f"faulted run stopped after step {steps}; training {steps} steps uninterrupted", flush=True
    )
    with (workdir / "reference.err").open("wb") as err:
        done = subprocess.run(
            _train_command(cfg, data, reference_dir, steps),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
            check=False,
        )
    if done.returncode != 0:
        report.problems.append(f"the uninterrupted run ended with status {done.returncode}")
    reference = losses(reference_dir / "metrics.jsonl") if done.returncode == 0 else []
    stderr = err_path.read_text(encoding="utf-8", errors="replace")
    return analyse(report, stderr, faulted, reference)


def main(argv: list[str] | None = None) -> int:
    """``soak.py --faults``: run the fault soak; 0 when the curves are equal and nothing was off."""
    d = FaultConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--faults", action="store_true", help="(this soak)")
    p.add_argument("--minutes", type=float, default=d.minutes, help="faulted training time")
    p.add_argument("--seed", type=int, default=d.seed, help="kill times, ranks, and the run's")
    p.add_argument("--world-size", type=int, default=d.world_size)
    p.add_argument("--preset", default=d.preset)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--seq", type=int, default=d.seq)
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every)
    p.add_argument(
        "--async-checkpoint", action="store_true", help="save in the background (shard train's)"
    )
    p.add_argument("--mean-interval", type=float, default=d.mean_interval, help="s between kills")
    p.add_argument("--min-interval", type=float, default=d.min_interval, help="s between kills")
    p.add_argument("--workdir", help="keep the runs here (default: a temporary directory)")
    p.add_argument("--json", help="write the report here")
    a = p.parse_args(argv)
    if not a.min_interval <= a.mean_interval:
        p.error("--min-interval must not exceed --mean-interval")
    cfg = FaultConfig(
        minutes=a.minutes,
        seed=a.seed,
        world_size=a.world_size,
        preset=a.preset,
        batch=a.batch,
        seq=a.seq,
        ckpt_every=a.ckpt_every,
        async_checkpoint=a.async_checkpoint,
        mean_interval=a.mean_interval,
        min_interval=a.min_interval,
    )
    with tempfile.TemporaryDirectory(prefix="soak_faults_") as tmp:
        workdir = Path(a.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        report = run_fault_soak(cfg, workdir)
    for line in summary_lines(report):
        print(line)
    if a.json:
        Path(a.json).write_text(json.dumps(asdict(report), indent=1), encoding="utf-8")
    return 0 if report.equal and not report.problems else 1
