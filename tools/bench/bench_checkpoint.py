"""Checkpoint benchmark: checksum speed, what checksums add to a save and a load, async saves.

Why: shard-checkpoint writes CRC-32C checksums with every checkpoint and
checks them on load ([Note: checkpoint checksums]), and ``async_save`` /
``shard train --async-checkpoint`` write in the background ([Note:
asynchronous saves]); both are only worth having if they cost little next to
the save itself and to a training step. The model is ``shard train``'s
default: the ``small`` preset GPT (3 blocks of width 128, ~0.6 M parameters,
96-character vocabulary, seq 64, batch 16 per rank) with AdamW state,
``fully_shard`` on every block and the root, 2 gloo ranks. Three parts
(``--parts`` picks):

- ``checksums``: MB/s of ``zlib.crc32`` (standard library), ``crc32c``
  (the dependency) and ``xxhash.xxh3_64`` (if installed) over buffers of the
  sizes a rank writes for this model (each tensor shard, and a whole rank's
  file), and over 4 and 64 MiB; best of 5, one process.
- ``overhead``: per round, in an order rotated by one each round, the wall time of ``save`` as
  shard-checkpoint does it, of the same ``save`` through DCP's plain
  ``FileSystemWriter`` (no checksums: same staging and rename), of ``save``
  with ``verify=True``, and of PyTorch's ``dcp.save``; then ``load`` (every
  item's bytes checked), ``load`` through DCP's plain ``FileSystemReader``
  (structure checked, data not), and ``dcp.load``. Slowest rank per round,
  median over ``--rounds``; the overhead is checksummed / plain - 1.
- ``async``: ``--steps`` training steps three ways, in fresh processes: no
  save; a blocking ``save`` every ``--every`` steps; ``async_save`` every
  ``--every`` steps. A step's time is the slowest rank's (forward, backward,
  AdamW, and the save call on a saving step). Reported: the median step
  without a save; the blocking saving step; for async, the steps from the
  one that called ``async_save`` up to the one during which the save
  completed ("steps while saving"), and the time ``async_save`` blocked.

Run from the repository root::

    .venv/bin/python tools/bench/bench_checkpoint.py
    .venv/bin/python tools/bench/bench_checkpoint.py --parts async --steps 60 --every 10

On this project's 2-core machine the two ranks, gloo and the writer thread
share two cores, so a background save takes CPU from training; with the
model on a GPU it would not. Check ``uptime`` first: the figures are only
comparable on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh

from shard_checkpoint import (
    async_save,
    get_model_state_dict,
    get_optimizer_state_dict,
    load,
    save,
)
from shard_checkpoint._storage import quiet_single_process
from shard_cli._presets import get_preset
from shard_cli.gpt import GPT, GPTConfig, synthetic_tokens
from shard_runtime import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import run_ranks

VOCAB = 96  # shard train's default data: the characters of shard's sources
BATCH, SEQ = 16, 64


def _config() -> GPTConfig:
    return get_preset("small").config(vocab_size=VOCAB, seq_len=SEQ)


# ------------------------------------------------------------------ checksums


def _checksum_functions() -> dict[str, Callable[[memoryview], int]]:
    functions: dict[str, Callable[[memoryview], int]] = {
        "zlib.crc32": zlib.crc32,
        "crc32c.crc32c": crc32c.crc32c,
    }
    try:
        import xxhash

        functions["xxhash.xxh3_64"] = xxhash.xxh3_64_intdigest
    except ImportError:
        pass
    return functions


def _rank_sizes(world: int) -> list[int]:
    """Bytes of each tensor shard one rank writes for the model and AdamW (2 per parameter)."""
    with torch.device("meta"):
        model = GPT(_config())
    sizes = []
    for param in model.parameters():
        rows = -(-param.shape[0] // world)
        shard = rows * (param.numel() // param.shape[0]) * param.element_size()
        sizes += [shard] * 3  # the parameter, exp_avg, exp_avg_sq
    return sizes


def bench_checksums(world: int) -> None:
    sizes = _rank_sizes(world)
    cases = sorted({*sizes, 4 << 20, 64 << 20})
    functions = _checksum_functions()
    print(
        f"checksum throughput, MB/s (best of 5; model shards of one of {world} ranks, "
        f"{len(sizes)} tensors, {sum(sizes) / 1e6:.2f} MB in all)"
    )
    print(f"{'bytes':>10}  " + "  ".join(f"{name:>15}" for name in functions))
    totals = dict.fromkeys(functions, 0.0)
    for size in cases:
        data = memoryview(os.urandom(size))
        reps = max(3, (64 << 20) // size)
        row = []
        for name, function in functions.items():
            best = min(_timed(_repeat(function, data, reps)) for _ in range(5))
            row.append(size * reps / best / 1e6)
            totals[name] += sizes.count(size) * best / reps
        print(f"{size:>10}  " + "  ".join(f"{mbs:>15,.0f}" for mbs in row))
    print(f"{'one rank':>10}  " + "  ".join(f"{totals[n] * 1e3:>12.3f} ms" for n in functions))
    print("(one rank: the time to checksum every tensor shard one rank writes)")


def _repeat(
    function: Callable[[memoryview], int], data: memoryview, reps: int
) -> Callable[[], None]:
    def work() -> None:
        for _ in range(reps):
            function(data)

    return work


def _timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


# ------------------------------------------------------------------ ranks


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(_config())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    tokens = synthetic_tokens(_config(), BATCH * dist.get_world_size(), seed=0, step=step)
    rows = tokens[dist.get_rank() * BATCH : (dist.get_rank() + 1) * BATCH]
    logits = model(rows[:, :-1])
    F.cross_entropy(logits.reshape(-1, VOCAB), rows[:, 1:].reshape(-1)).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}


def _slowest(seconds: float) -> float:
    box = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return float(box.item())


def _timed_collective(work: Callable[[], object]) -> tuple[float, float]:
    """Wall and CPU seconds of ``work`` on the slowest rank (CPU: every thread of the process)."""
    dist.barrier()
    cpu = time.process_time()
    wall = _timed(work)
    cpu = time.process_time() - cpu
    return _slowest(wall), _slowest(cpu)


def _rotated(names: list[str], index: int) -> list[str]:
    """Round ``index``'s order: each name takes each place equally often over the rounds.

    The first save of a round follows the previous round's clean-up and the
    last follows the loads' reads; an order that only alternated (ABCD, DCBA)
    kept one save first or last every round and charged it those effects
    (checksums looked 7-12% dearer than the same saves timed side by side).
    """
    shift = index % len(names)
    return names[shift:] + names[:shift]


def _overhead_rank(rank: int, queue: Any, world: int, port: int, rounds: int, root: str) -> None:
    _init(rank, world, port)
    model, optim = _model()
    _step(model, optim, 0)
    state = _state(model, optim)
    saves: dict[str, Callable[[str], object]] = {
        "save, checksums": lambda path: save(state, checkpoint_id=path),
        "save, no checksums": lambda path: save(
            state, checkpoint_id=path, storage_writer=FileSystemWriter(path)
        ),
        "save, checksums + verify": lambda path: save(state, checkpoint_id=path, verify=True),
        "dcp.save": lambda path: dcp.save(state, checkpoint_id=path),
    }
    loads: dict[str, Callable[[str], object]] = {
        "load, checksums": lambda path: load(state, checkpoint_id=path),
        "load, structure only": lambda path: load(
            state, checkpoint_id=path, storage_reader=FileSystemReader(path)
        ),
        "dcp.load": lambda path: dcp.load(state, checkpoint_id=path),
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in [*saves, *loads]}
    for index in range(rounds):
        for name in _rotated(list(saves), index):
            path = f"{root}/{name.replace(' ', '_').replace(',', '')}-{index}"
            times[name].append(_timed_collective(lambda f=saves[name], p=path: f(p)))
        written = f"{root}/save_checksums-{index}"
        for name in _rotated(list(loads), index):
            times[name].append(_timed_collective(lambda f=loads[name], p=written: f(p)))
        dist.barrier()
        if rank == 0:
            for path in Path(root).iterdir():
                shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
    if rank == 0:
        queue.put(
            {
                name: (
                    statistics.median(w for w, _ in values),
                    statistics.median(c for _, c in values),
                )
                for name, values in times.items()
            }
        )
    else:
        queue.put(None)
    dist.destroy_process_group()


def bench_overhead(world: int, rounds: int) -> None:
    root = tempfile.mkdtemp(prefix="bench-ckpt-")
    try:
        results = run_ranks(
            "overhead",
            world,
            _overhead_rank,
            lambda rank, queue: (rank, queue, world, 29731, rounds, root),
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    medians = next(r for r in results if r is not None)
    print(
        f"\nsave and load of the model + AdamW, {world} ranks, slowest rank, median of {rounds} "
        "rounds (ms)"
    )
    print(f"  {'':<28} {'wall':>9} {'cpu':>9}")
    for name, (wall, cpu) in medians.items():
        print(f"  {name:<28} {wall * 1e3:9.2f} {cpu * 1e3:9.2f}")
    for index, clock in enumerate(("wall", "cpu")):

        def ratio(a: str, b: str, i: int = index) -> float:
            return float(medians[a][i] / medians[b][i] - 1)

        print(
            f"  {clock}: checksums add {ratio('save, checksums', 'save, no checksums'):+.1%} to "
            f"a save and {ratio('load, checksums', 'load, structure only'):+.1%} to a load; "
            f"verify=True adds {ratio('save, checksums + verify', 'save, checksums'):+.1%} to a "
            "save"
        )


# ------------------------------------------------------------------ async


def _async_rank(
    rank: int, queue: Any, world: int, port: int, mode: str, steps: int, every: int, root: str
) -> None:
    _init(rank, world, port)
    model, optim = _model()
    step_times: list[float] = []
    saving_steps: list[list[int]] = []  # per save: the steps while it was in flight
    blocked: list[float] = []
    in_flight = None
    for step in range(steps):
        dist.barrier()
        started = time.perf_counter()
        _step(model, optim, step)
        if (step + 1) % every == 0 and mode != "none":
            path = f"{root}/{mode}/step-{step + 1}"
            if mode == "blocking":
                save(_state(model, optim), checkpoint_id=path)
                saving_steps.append([step])
            else:
                in_flight = async_save(_state(model, optim), checkpoint_id=path)
                blocked.append(in_flight.blocked_s)
                saving_steps.append([step])
        elif in_flight is not None:
            saving_steps[-1].append(step)
        if in_flight is not None and in_flight.done():
            in_flight.result()
            in_flight = None
        step_times.append(time.perf_counter() - started)
    if in_flight is not None:
        in_flight.result()
    slowest = [_slowest(t) for t in step_times]
    # A save is in flight on some rank until every rank saw it done.
    flights = [sorted(set(s)) for s in saving_steps]
    if rank == 0:
        queue.put({"steps": slowest, "saving": flights, "blocked": blocked})
    else:
        queue.put(None)
    dist.destroy_process_group()


def bench_async(world: int, steps: int, every: int, warmup: int) -> None:
    root = tempfile.mkdtemp(prefix="bench-ckpt-async-")
    results: dict[str, dict[str, Any]] = {}
    try:
        for index, mode in enumerate(("none", "blocking", "async", "async", "blocking", "none")):
            [result] = [
                r
                for r in run_ranks(
                    f"async {mode}",
                    world,
                    _async_rank,
                    lambda rank, queue, m=mode, i=index: (
                        rank,
                        queue,
                        world,
                        29741 + i,
                        m,
                        steps,
                        every,
                        root,
                    ),
                )
                if r is not None
            ]
            kept = results.setdefault(mode, {"steps": [], "saving": [], "blocked": []})
            offset = len(kept["steps"])
            kept["steps"] += result["steps"]
            kept["saving"] += [[offset + s for s in flight] for flight in result["saving"]]
            kept["blocked"] += result["blocked"]
            shutil.rmtree(Path(root) / mode, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def after_warmup(step_index: int) -> bool:
        return step_index % steps >= warmup

    def kept_steps(mode: str) -> list[float]:
        return [t for i, t in enumerate(results[mode]["steps"]) if after_warmup(i)]

    plain = statistics.median(kept_steps("none"))
    plain_mean = statistics.mean(kept_steps("none"))
    blocking_saves = [
        results["blocking"]["steps"][flight[0]]
        for flight in results["blocking"]["saving"]
        if after_warmup(flight[0])
    ]
    async_flights = [f for f in results["async"]["saving"] if after_warmup(f[0])]
    while_saving = [results["async"]["steps"][i] for flight in async_flights for i in flight]
    calling = [results["async"]["steps"][flight[0]] for flight in async_flights]
    print(
        f"\nstep time, {world} ranks, {steps} steps x 2 runs per mode, a save every {every} "
        f"steps (model + AdamW), first {warmup} steps of a run left out (ms)"
    )
    print(
        f"  no save: median step                       {plain * 1e3:9.2f}"
        f"  (mean {plain_mean * 1e3:.2f})"
    )
    blocking = statistics.median(blocking_saves)
    print(
        f"  blocking save: median saving step          {blocking * 1e3:9.2f}"
        f"  ({blocking / plain:.2f}x; adds {(blocking - plain) * 1e3:.1f} per save)"
    )
    mean_while = statistics.mean(while_saving)
    median_while = statistics.median(while_saving)
    added = (sum(while_saving) - len(while_saving) * plain_mean) / len(async_flights)
    print(
        f"  async save: mean step while saving         {mean_while * 1e3:9.2f}"
        f"  ({mean_while / plain_mean:.2f}x the mean without saves;"
        f" median {median_while * 1e3:.2f}, {median_while / plain:.2f}x)"
    )
    print(
        f"    {len(while_saving)} steps over {len(async_flights)} saves,"
        f" {statistics.mean(len(f) for f in async_flights):.1f} steps per save;"
        f" adds {added * 1e3:.1f} per save in all"
    )
    staging = statistics.median(results["async"]["blocked"])
    print(
        f"  async save: median step that called it     {statistics.median(calling) * 1e3:9.2f}"
        f"  (of which async_save blocked {staging * 1e3:.2f})"
    )
    print(
        f"  mean step over the whole run: no save {plain_mean * 1e3:.2f}, blocking"
        f" {statistics.mean(kept_steps('blocking')) * 1e3:.2f},"
        f" async {statistics.mean(kept_steps('async')) * 1e3:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="checksums,overhead,async")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--rounds", type=int, default=60, help="overhead: rounds (order rotated each round)"
    )
    parser.add_argument("--steps", type=int, default=40, help="async: steps per run")
    parser.add_argument("--every", type=int, default=10, help="async: save every N steps")
    parser.add_argument("--warmup", type=int, default=3, help="async: steps left out per run")
    args = parser.parse_args()
    parts = args.parts.split(",")
    print(f"load average: {os.getloadavg()[0]:.2f}, cpus: {os.cpu_count()}")
    with quiet_single_process():
        if "checksums" in parts:
            bench_checksums(args.world_size)
        if "overhead" in parts:
            bench_overhead(args.world_size, args.rounds)
        if "async" in parts:
            bench_async(args.world_size, args.steps, args.every, args.warmup)
    print(f"load average: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
