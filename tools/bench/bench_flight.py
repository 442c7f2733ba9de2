"""What the flight recorder costs: per collective, and per training step.

Two measurements:

- micro: ``FlightRecorder.issue`` + ``complete`` in a tight loop (what every
  collective pays), against the same loop with the recorder off
  (``SHARD_FLIGHT_RECORDER=0``, capacity 0);
- step: ``--world-size`` gloo ranks (2 by default) train a stack of
  ``--blocks`` linear blocks under ``fully_shard``; rounds with the recorder
  on and off alternate (so both see the same background load) and the table
  reports the median step time of each, the collectives per step, and the
  recorder's share of a step computed from the micro cost (the A/B difference
  of two medians is below the noise of a shared machine).

The verdict is the computed share against the 1% budget. Run::

    python tools/bench/bench_flight.py --iters 30 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import shard_comms as sc
from shard_comms import _flight

BUDGET = 0.01  # the recorder may cost at most 1% of a step


def micro(calls: int) -> dict[str, float]:
    """Microseconds per issue + complete, recorder on (2048 entries) and off."""
    out: dict[str, float] = {}
    for name, capacity in (("on", 2048), ("off", 0)):
        recorder = sc.FlightRecorder(capacity)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                entry = recorder.issue(
                    "all_gather", "layers.3", "forward all-gather", None, 4096, 16384, torch.float32
                )
                recorder.complete(entry)
            best = min(best, time.perf_counter() - start)
        out[name] = best / calls * 1e6
    return out


def _rank(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    from shard_runtime import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(torch.nn.Linear(args.width, args.width) for _ in range(args.blocks))
    )
    for block in model:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch, args.width)

    def step() -> None:
        model(x).sum().backward()
        optim.step()
        optim.zero_grad()

    for _ in range(3):
        step()
    with sc.count_collectives() as counts:
        step()
    times: dict[str, list[float]] = {"on": [], "off": []}
    recorders = {"on": sc.FlightRecorder(2048), "off": sc.FlightRecorder(0)}
    cases = list(recorders)
    for round_ in range(args.iters):
        for name in cases if round_ % 2 else cases[::-1]:  # alternate which goes first
            _flight._RECORDER = recorders[name]  # swapped in place: no new ring per round
            dist.barrier()
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    result = {name: statistics.median(values) for name, values in times.items()}
    result.update({f"{name}_min": min(values) for name, values in times.items()})
    result["collectives"] = counts.calls()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo may abort in interpreter teardown


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    cost = micro(args.calls)
    print(
        f"micro: issue+complete {cost['on']:.2f} us with the recorder on, {cost['off']:.2f} us off"
    )

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "step.json")
        init = f"file://{os.path.join(tmp, 'store')}"
        mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
            _rank,
            args=(args.world_size, init, args, out),
            nprocs=args.world_size,
            start_method="spawn",
        )
        with open(out) as f:
            step: dict[str, Any] = json.load(f)
    per_step_us = (cost["on"] - cost["off"]) * step["collectives"]
    share = per_step_us / (step["off"] * 1e6)
    print(
        f"step ({args.world_size} gloo ranks, {args.blocks} blocks of {args.width}, "
        f"batch {args.batch}): median {step['on'] * 1e3:.2f} ms recorder on, "
        f"{step['off'] * 1e3:.2f} ms off (fastest {step['on_min'] * 1e3:.2f} / "
        f"{step['off_min'] * 1e3:.2f} ms); {step['collectives']} collectives per step"
    )
    print(
        f"recorder per step: {per_step_us:.1f} us = {share:.3%} of a step "
        f"(A/B difference of medians: {(step['on'] / step['off'] - 1):+.2%})"
    )
    verdict = "PASS" if share < BUDGET else "FAIL"
    print(f"verdict: {verdict} (budget {BUDGET:.0%} of a step)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"micro_us": cost, "step_s": step, "share": share, "verdict": verdict}, f, indent=1
            )
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
