"""Benchmark shard's collectives against plain torch.distributed on gloo.

Spawns ``--world-size`` ranks (2 by default) on gloo, then for every size in
``--sizes`` (MiB of fp32 per rank, unsharded) times:

- all-gather: ``shard_comms.all_gather`` vs ``dist.all_gather_single``;
- reduce-scatter: ``dist.reduce_scatter_single`` vs ``dist.all_reduce`` plus a
  copy of the rank's slice, vs ``shard_comms.reduce_scatter`` (auto, which
  picks the all-reduce form on gloo) and forced to ``reduce_scatter_single``;
- staging buffers: ``shard_comms.reduce_scatter`` of an fp32 gradient in bf16
  with the buffer cache (reused) vs with the cache cleared before every call
  (fresh), and a plain copy into an existing buffer vs into a fresh one;
- one unit of 8 tensors: packed into one buffer for one ``shard_comms.all_gather``
  (what the runtime does per unit) vs 8 all-gathers.

Cases of a group run interleaved, round by round, each after a barrier; the
table reports the median over ``--iters`` rounds (the slowest rank's), the
algorithm bandwidth (unsharded bytes / time) and the ratio to the group's
first row. Run::

    python tools/bench/bench_comms.py --sizes 1 16 64 --iters 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import shard_comms as sc
from shard_comms import plumbing

MiB = 1 << 20


def _time_group(fns: list[Callable[[], object]], iters: int, warmup: int) -> list[float]:
    """Median seconds of each of ``fns``, interleaved round by round, each run after a barrier.

    Interleaving puts every case of a group under the same background load,
    which matters on a shared machine.
    """
    for _ in range(warmup):
        for fn in fns:
            dist.barrier()
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, times in zip(fns, samples, strict=True):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    # Every rank reports its medians; the slowest rank is the collective's time.
    medians = torch.tensor([statistics.median(t) for t in samples], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return [float(m) for m in medians]


def _cases(size_mib: float, world: int, rank: int) -> list[tuple[str, str, Callable[[], object]]]:
    """(group, name, fn) for one size; the first case of each group is its baseline."""
    numel = int(size_mib * MiB) // 4 // world * world
    shard_numel = numel // world
    shard = torch.randn(shard_numel)
    gathered = torch.empty(numel)
    grad = torch.zeros(numel)
    out = torch.empty(shard_numel)
    out_slice = slice(rank * shard_numel, (rank + 1) * shard_numel)
    copy_source = torch.randn(numel)
    copy_target = torch.empty(numel)

    def plain_reduce_scatter() -> None:
        dist.reduce_scatter_single(out, grad)

    def all_reduce_then_copy() -> None:
        dist.all_reduce(grad)
        out.copy_(grad[out_slice])

    def ours_fresh_cast() -> None:
        plumbing.clear_buffer_cache()
        sc.reduce_scatter(out, grad, reduce_dtype=torch.bfloat16)

    pieces = 8
    piece = shard_numel // pieces
    piece_shards = [torch.randn(piece) for _ in range(pieces)]
    piece_outputs = [torch.empty(piece * world) for _ in range(pieces)]
    packed_in = torch.empty(piece * pieces)
    packed_out = torch.empty(piece * pieces * world)

    def packed_all_gather() -> None:
        torch.cat(piece_shards, out=packed_in)
        sc.all_gather(packed_out, packed_in)
        rows = packed_out.view(world, pieces, piece)
        for index, output in enumerate(piece_outputs):
            output.view(world, piece).copy_(rows[:, index])

    def per_tensor_all_gathers() -> None:
        for out_piece, shard_piece in zip(piece_outputs, piece_shards, strict=True):
            dist.all_gather_single(out_piece, shard_piece)

    return [
        ("all_gather", "plain all_gather_single", lambda: dist.all_gather_single(gathered, shard)),
        ("all_gather", "shard all_gather", lambda: sc.all_gather(gathered, shard)),
        ("reduce_scatter", "plain reduce_scatter_single", plain_reduce_scatter),
        ("reduce_scatter", "plain all_reduce + copy slice", all_reduce_then_copy),
        ("reduce_scatter", "shard reduce_scatter (auto)", lambda: sc.reduce_scatter(out, grad)),
        (
            "reduce_scatter",
            "shard reduce_scatter (forced rs)",
            lambda: sc.reduce_scatter(out, grad, algorithm="reduce_scatter"),
        ),
        ("staging", "shard rs bf16, fresh buffers", ours_fresh_cast),
        (
            "staging",
            "shard rs bf16, cached buffers",
            lambda: sc.reduce_scatter(out, grad, reduce_dtype=torch.bfloat16),
        ),
        ("copy", "copy into fresh buffer", lambda: torch.empty(numel).copy_(copy_source)),
        ("copy", "copy into existing buffer", lambda: copy_target.copy_(copy_source)),
        ("unit of 8 tensors", "8 x all_gather_single", per_tensor_all_gathers),
        ("unit of 8 tensors", "shard all_gather, packed unit", packed_all_gather),
    ]


def _rank_main(rank: int, world: int, store_path: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world
    )
    rows: list[dict[str, Any]] = []
    for size in args.sizes:
        nbytes = int(size * MiB) // 4 // world * world * 4
        groups: dict[str, list[tuple[str, Callable[[], object]]]] = {}
        for group, name, fn in _cases(size, world, rank):
            groups.setdefault(group, []).append((name, fn))
        for group, cases in groups.items():
            medians = _time_group([fn for _, fn in cases], args.iters, args.warmup)
            for (name, _), seconds in zip(cases, medians, strict=True):
                rows.append(
                    {
                        "group": group,
                        "case": name,
                        "size_mib": size,
                        "median_ms": seconds * 1e3,
                        "algbw_gbs": nbytes / seconds / 1e9,
                        "ratio_to_baseline": seconds / medians[0],
                    }
                )
    if rank == 0:
        with open(args.result_path, "w") as file:
            json.dump(rows, file)
    dist.barrier()
    dist.destroy_process_group()


def _print_table(rows: list[dict[str, Any]], world: int, iters: int) -> None:
    print(f"gloo, world size {world}, median of {iters} iterations (rank-max), fp32")
    header = (
        f"{'size':>6}  {'group':<18} {'case':<34} {'median ms':>10} {'GB/s':>8} {'vs first':>9}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['size_mib']:>4g}Mi  {row['group']:<18} {row['case']:<34} "
            f"{row['median_ms']:>10.3f} {row['algbw_gbs']:>8.2f} {row['ratio_to_baseline']:>8.2f}x"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        type=float,
        nargs="+",
        default=[1.0, 16.0, 64.0],
        help="unsharded sizes in MiB (default: 1 16 64)",
    )
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per case")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations per case")
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks to spawn")
    parser.add_argument("--json", metavar="OUT", help="also write the rows as JSON to OUT")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        args.result_path = os.path.join(tmp, "rows.json")
        mp.start_processes(
            _rank_main,
            args=(args.world_size, os.path.join(tmp, "store"), args),
            nprocs=args.world_size,
            start_method="spawn",
        )
        with open(args.result_path) as file:
            rows = json.load(file)
    _print_table(rows, args.world_size, args.iters)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(
                {"world_size": args.world_size, "iters": args.iters, "rows": rows}, file, indent=2
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
