"""The summary ``shard train`` prints at the end: memory, communication, time, a sample.

Pure formatting of a :class:`~shard_cli._summary.RunSummary`, so it is tested
without running anything.
"""

from __future__ import annotations

from shard_cli._format import format_bytes, format_duration, format_rate
from shard_cli._summary import RunSummary

__all__ = ["summary_lines"]

_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:9.3f}"


def summary_lines(summary: RunSummary, *, sample: str = "") -> list[str]:
    """The lines of the end-of-run summary."""
    s = summary
    lines = [
        "",
        f"done: loss {s.first_loss:.3f} -> {s.last_loss:.3f} over {s.steps_run} steps in "
        f"{format_duration(s.wall_s)} ({format_rate(s.tokens_per_s)} tokens/s)",
        "",
        f"memory per rank (MiB)        params     grads     AdamW      peak"
        f"   (peak: tensors, steps {s.measured_step}-{s.measured_step + s.measured_steps - 1})",
    ]
    for r in s.ranks:
        lines.append(
            f"  rank {r['rank']:<22d}{_mb(r['params'])} {_mb(r['grads'])} "
            f"{_mb(r['optim'])} {_mb(r['peak'])}"
        )
    plan, single = s.plan, s.unsharded
    lines.append(
        f"  shard plan (rank 0)       {_mb(plan['params'])} {_mb(plan['grads'])} "
        f"{_mb(plan['optim'])} {_mb(plan['peak'])}"
    )
    lines.append(
        f"  1 process, unsharded      {_mb(single['params'])} {_mb(single['grads'])} "
        f"{_mb(single['optim'])} {_mb(single['peak'])}"
    )
    if s.trainable is not None and s.trainable < s.parameters:
        lines.append(
            f"  {s.trainable:,} of {s.parameters:,} parameters train "
            f"({s.trainable / s.parameters:.2%}): gradients and AdamW state for those only"
        )
    state = s.ranks[0]["params"] + s.ranks[0]["grads"] + s.ranks[0]["optim"]
    single_state = single["params"] + single["grads"] + single["optim"]
    if single_state:
        lines.append(
            f"  rank 0 holds {state / single_state:.0%} of the unsharded parameters + "
            f"gradients + AdamW state; process peak (RSS) {format_bytes(s.ranks[0]['rss_peak'])}"
        )
    lines += ["", "communication per step         calls         MiB"]
    for kind in _KINDS:
        stats = s.comm_per_step.get(kind, {"calls": 0, "bytes": 0})
        lines.append(f"  {kind:<26}{stats['calls']:>7d} {_mb(stats['bytes'])}")
    t = s.time
    if t.get("step_s"):
        share = t["comm_s"] / t["step_s"]
        lines.append(
            f"time per step (profiled, rank 0): {t['step_s'] * 1e3:.1f} ms = "
            f"{t['comm_s'] * 1e3:.1f} ms communication ({share:.0%}) + "
            f"{t['compute_s'] * 1e3:.1f} ms compute"
        )
    if sample:
        lines += ["", "sample:", sample]
    return lines
