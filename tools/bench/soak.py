"""Soak: train for hundreds of steps under both front ends; does any rank's memory grow?

Why: a leak of a few KiB per step (a tensor kept per step by a hook, a cache
keyed by something new every step, a checkpoint that leaves buffers behind)
is invisible in the few steps a test runs and fatal in a week-long job. This
script trains ``shard train``'s model with ``shard train``'s own pieces
(``shard_cli``: the corpus, the batches from the step, ``shard_model`` with
``--strategy full`` and block units, ``save_training`` every
``--ckpt-every`` steps) under ``fully_shard`` and under the wrapper, each in
fresh gloo processes on the CPU, and reports per rank how the memory moved
after the warm-up.

Run from the repository root::

    .venv/bin/python tools/bench/soak.py --world-size 2 --steps 800 --warmup 300

``--faults`` runs the other soak, of restarts: ``shard train
--max-restarts`` for ``--minutes`` while a random rank is killed at random
times, its loss curve compared with an uninterrupted run's
(``soak_faults.py``, which says how).

[Note: what the soak measures]
Both figures are taken at the same point of every step: after the
optimizer step, ``zero_grad(set_to_none=True)``, the loss's all-reduce and
(every ``--ckpt-every`` steps) the checkpoint, so that a step that leaks
nothing leaves exactly what the previous one left.
- RSS, every step: the process's resident set (``/proc/self/statm``, or
  ``ru_maxrss`` elsewhere). It sees everything, C++ buffers (gloo's, the
  allocator's) included, but also the allocator's fragmentation and pages
  it keeps, so it moves by a few MiB without any leak.
- heap, every step (glibc only): ``mallinfo2()``'s bytes in use, over every
  arena and the mmapped chunks. What RSS sees without the pages the
  allocator keeps free: it moves by what was allocated and not freed.
- live tensor bytes, every ``--sample-every`` steps: after ``gc.collect()``,
  the bytes of the distinct storages of every ``torch.Tensor`` the garbage
  collector tracks (``gc.get_objects()``; DTensors skipped, their local
  tensors counted; a storage shared by views counted once), and how many
  Python objects there are. This is exact (no allocator noise) but only
  sees tensors some Python object references, which is where leaks of the
  engine's Python code would be; a scan costs tens of milliseconds, hence
  the sampling. (A weak-reference counter on tensor creation was the other
  choice; it needs a hook on every tensor the engine creates, which would
  slow every step and miss the ones C++ creates anyway.)
The slope is the least-squares fit of bytes against the step over the
samples after ``--warmup`` steps. The default warm-up is long (300 steps)
because the heap settles late: it rises by about 1.3 MiB between steps 100
and 250 (both front ends, every rank) and is flat after. A tensor that a
collective's thread has not yet released can be alive at one sample (gloo
frees buffers from its own thread); such an outlier tilts the fit a little
but not the first and last samples. The verdict is "flat" when, for every rank,
the fitted growth over the measured steps (slope x steps) is below
``--rss-threshold-mib`` (RSS, default 8), ``--heap-threshold-mib`` (heap,
default 2) and ``--tensor-threshold-kib`` (tensors, default 64), and
"grows" otherwise, naming what grew. At the defaults that is a leak of
about 16 KiB (RSS), 4 KiB (heap) or 128 bytes (tensors) per step.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import run_ranks

FRONTENDS = ("fully_shard", "wrapper")


@dataclass(frozen=True)
class SoakConfig:
    """One soak: the model, the run and the verdict's thresholds."""

    world_size: int = 2
    preset: str = "tiny"
    batch: int = 4
    seq: int = 32
    steps: int = 800
    warmup: int = 300
    ckpt_every: int = 50
    sample_every: int = 10
    lr: float = 3e-3
    seed: int = 0
    rss_threshold_mib: float = 8.0
    heap_threshold_mib: float = 2.0
    tensor_threshold_kib: float = 64.0
    frontends: tuple[str, ...] = FRONTENDS


@dataclass
class RankTrace:
    """What one rank saw: RSS every step, tensors every ``sample_every`` steps."""

    rank: int
    parameters: int
    rss: list[tuple[int, int]] = field(default_factory=list)
    heap: list[tuple[int, int]] = field(default_factory=list)
    tensors: list[tuple[int, int, int, int]] = field(default_factory=list)  # step, bytes, n, objs
    losses: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    ckpt_s: float = 0.0
    scan_s: float = 0.0


# ---------------------------------------------------------------------- rank side


def _rss() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as file:
            return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (also read by ``memory_profile.py``)."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo2() -> Callable[[], int] | None:
    """glibc's bytes in use (all arenas, mmapped chunks included), or ``None`` without glibc."""
    try:
        libc = ctypes.CDLL(None)
        call = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    call.restype = MallInfo2

    def heap() -> int:
        info = call()
        return int(info.uordblks + info.hblkhd)

    return heap


def live_tensors() -> tuple[int, int, int]:
    """Bytes of the distinct storages of the live tensors, their count, and all objects.

    See [Note: what the soak measures].
    """
    gc.collect()
    objects = gc.get_objects()
    storages: dict[tuple[str, int], int] = {}
    count = 0
    for obj in objects:
        # type(), not isinstance(): the latter reads __class__, which some module proxies warn on.
        kind = type(obj)
        if not issubclass(kind, torch.Tensor) or issubclass(kind, DTensor):
            continue
        assert isinstance(obj, torch.Tensor)
        if obj.is_meta:
            continue
        try:
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage (sparse, some wrappers)
            continue
        count += 1
        if storage.data_ptr():
            storages[(str(storage.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values()), count, len(objects)


def _rank_main(rank: int, frontend: str, cfg: SoakConfig, tmp: str, queue: Any) -> None:
    from shard_cli._corpus import load_corpus
    from shard_cli._options import TrainOptions
    from shard_cli._strategy import resolve_policy, shard_layout, shard_model
    from shard_cli._train import model_config
    from shard_cli._train_checkpoint import save_training
    from shard_cli.gpt import GPT

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.world_size))
    init = f"file://{os.path.join(tmp, 'init')}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=cfg.world_size)
    options = TrainOptions(
        preset=cfg.preset,
        batch=cfg.batch,
        seq=cfg.seq,
        steps=cfg.steps,
        lr=cfg.lr,
        seed=cfg.seed,
        nproc=cfg.world_size,
        frontend=frontend,  # type: ignore[arg-type]
        ckpt_every=cfg.ckpt_every,
    )
    corpus = load_corpus()
    config = model_config(options, corpus.vocab_size)
    torch.manual_seed(cfg.seed)
    unsharded = GPT(config)
    trace = RankTrace(rank=rank, parameters=sum(p.numel() for p in unsharded.parameters()))
    model, mesh = shard_model(
        unsharded,
        frontend=options.frontend,
        strategy="full",
        layout=shard_layout("full", cfg.world_size),
        precision="fp32",
        cpu_offload=False,
        policy=resolve_policy("blocks"),
        device=torch.device("cpu"),
    )
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    ckpt = os.path.join(tmp, "checkpoint")
    heap = _mallinfo2()
    started = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        x, y = corpus.batch(step=step, rank=rank, batch=cfg.batch, seq=cfg.seq, seed=cfg.seed)
        logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, config.vocab_size), y.reshape(-1))
        loss.backward()  # type: ignore[no-untyped-call]
        optim.step()
        optim.zero_grad(set_to_none=True)
        loss = loss.detach()
        dist.all_reduce(loss)
        trace.losses.append(float(loss) / cfg.world_size)
        del logits, loss, x, y
        if step % cfg.ckpt_every == 0:
            began = time.perf_counter()
            save_training(
                ckpt,
                model=model,
                optim=optim,
                frontend=frontend,
                mesh=mesh,
                step=step,
                world_size=cfg.world_size,
            )
            trace.ckpt_s += time.perf_counter() - began
        trace.rss.append((step, _rss()))
        if heap is not None:
            trace.heap.append((step, heap()))
        if step == 1 or step % cfg.sample_every == 0:
            began = time.perf_counter()
            trace.tensors.append((step, *live_tensors()))
            trace.scan_s += time.perf_counter() - began
    trace.wall_s = time.perf_counter() - started
    dist.barrier()
    queue.put(trace)
    queue.close()
    queue.join_thread()


def _rank_entry(rank: int, frontend: str, cfg: SoakConfig, tmp: str, queue: Any) -> None:
    """Run the rank, then leave without interpreter teardown (gloo may abort in it)."""
    code = 0
    try:
        _rank_main(rank, frontend, cfg, tmp, queue)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---------------------------------------------------------------------- driver side


def _run(frontend: str, cfg: SoakConfig) -> list[RankTrace]:
    """One front end in fresh processes; its ranks' traces, by rank."""
    with tempfile.TemporaryDirectory(prefix="soak_") as tmp:
        traces = run_ranks(
            frontend,
            cfg.world_size,
            _rank_entry,
            lambda rank, queue: (rank, frontend, cfg, tmp, queue),
        )
    return sorted(traces, key=lambda t: t.rank)


def slope(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of ``(step, value)`` points (value units per step); 0 for < 2."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in points)
    return sxy / sxx if sxx else 0.0


@dataclass
class RankVerdict:
    """One rank's fitted growth after the warm-up."""

    frontend: str
    rank: int
    measured_steps: int
    rss_first: int
    rss_last: int
    rss_slope: float
    heap_first: int
    heap_last: int
    heap_slope: float
    tensor_first: int
    tensor_last: int
    tensor_slope: float
    tensors_first: int
    tensors_last: int
    objects_slope: float
    grew: list[str]


def analyse(frontend: str, trace: RankTrace, cfg: SoakConfig) -> RankVerdict:
    """Slopes after ``cfg.warmup`` and what (if anything) grew past its threshold."""
    rss = [(s, b) for s, b in trace.rss if s > cfg.warmup]
    tensors = [t for t in trace.tensors if t[0] > cfg.warmup]
    if not rss or not tensors:
        raise ValueError(
            f"no samples after the warm-up ({cfg.warmup} steps of {cfg.steps}); run more "
            "--steps or a shorter --warmup"
        )
    measured = rss[-1][0] - rss[0][0]
    rss_slope = slope(rss)
    heap = [(s, b) for s, b in trace.heap if s > cfg.warmup]
    heap_slope = slope(heap)
    tensor_slope = slope([(s, b) for s, b, _, _ in tensors])
    grew = []
    if rss_slope * measured > cfg.rss_threshold_mib * 2**20:
        grew.append(f"RSS +{rss_slope * measured / 2**20:.1f} MiB")
    if heap_slope * measured > cfg.heap_threshold_mib * 2**20:
        grew.append(f"heap +{heap_slope * measured / 2**20:.2f} MiB")
    if tensor_slope * measured > cfg.tensor_threshold_kib * 2**10:
        grew.append(f"tensors +{tensor_slope * measured / 2**10:.1f} KiB")
    return RankVerdict(
        frontend=frontend,
        rank=trace.rank,
        measured_steps=measured,
        rss_first=rss[0][1],
        rss_last=rss[-1][1],
        rss_slope=rss_slope,
        heap_first=heap[0][1] if heap else 0,
        heap_last=heap[-1][1] if heap else 0,
        heap_slope=heap_slope,
        tensor_first=tensors[0][1],
        tensor_last=tensors[-1][1],
        tensor_slope=tensor_slope,
        tensors_first=tensors[0][2],
        tensors_last=tensors[-1][2],
        objects_slope=slope([(s, o) for s, _, _, o in tensors]),
        grew=grew,
    )


def report(cfg: SoakConfig, results: dict[str, list[RankTrace]], wall: dict[str, float]) -> str:
    """The table and one verdict line per front end."""
    parameters = next(iter(results.values()))[0].parameters
    lines = [
        f"soak: preset {cfg.preset} ({parameters / 1e6:.2f} M parameters), {cfg.world_size} "
        f"ranks (gloo, cpu), {cfg.steps} steps, batch {cfg.batch}x{cfg.seq}, checkpoint every "
        f"{cfg.ckpt_every}; slopes are least squares over steps {cfg.warmup + 1}-{cfg.steps}",
        "",
        f"{'front end':<12} {'rank':>4} {'RSS MiB':>17} {'RSS B/step':>11} "
        f"{'heap MiB':>17} {'heap B/step':>11} "
        f"{'tensors KiB':>17} {'tensor B/step':>13} {'#tensors':>9} {'objects/step':>12}",
    ]
    verdicts: dict[str, list[RankVerdict]] = {}
    for frontend, traces in results.items():
        verdicts[frontend] = [analyse(frontend, t, cfg) for t in traces]
        for v in verdicts[frontend]:
            lines.append(
                f"{frontend:<12} {v.rank:>4} "
                f"{v.rss_first / 2**20:>7.1f} -> {v.rss_last / 2**20:>6.1f} "
                f"{v.rss_slope:>11.1f} "
                f"{v.heap_first / 2**20:>7.1f} -> {v.heap_last / 2**20:>6.1f} "
                f"{v.heap_slope:>11.1f} "
                f"{v.tensor_first / 2**10:>7.1f} -> {v.tensor_last / 2**10:>6.1f} "
                f"{v.tensor_slope:>13.2f} {v.tensors_first:>4}->{v.tensors_last:<4} "
                f"{v.objects_slope:>12.3f}"
            )
    lines.append("")
    for frontend, traces in results.items():
        grew = [f"rank {v.rank}: {', '.join(v.grew)}" for v in verdicts[frontend] if v.grew]
        ckpt = max(t.ckpt_s for t in traces)
        scan = max(t.scan_s for t in traces)
        timing = (
            f"wall {wall[frontend]:.1f} s (training loop {max(t.wall_s for t in traces):.1f} s, "
            f"of which checkpoints {ckpt:.1f} s, tensor scans {scan:.1f} s)"
        )
        if grew:
            verdict = "grows: " + "; ".join(grew)
        else:
            verdict = (
                f"flat (growth after warm-up below {cfg.rss_threshold_mib:g} MiB RSS, "
                f"{cfg.heap_threshold_mib:g} MiB heap and {cfg.tensor_threshold_kib:g} KiB "
                "tensors on every rank)"
            )
        lines.append(f"{frontend}: {verdict}; {timing}")
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> tuple[SoakConfig, str | None]:
    d = SoakConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--world-size", type=int, default=d.world_size)
    p.add_argument("--preset", default=d.preset, help="a shard train preset (default tiny)")
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--seq", type=int, default=d.seq)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--warmup", type=int, default=d.warmup, help="steps left out of the fit")
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every)
    p.add_argument("--sample-every", type=int, default=d.sample_every, help="tensor scans")
    p.add_argument("--rss-threshold-mib", type=float, default=d.rss_threshold_mib)
    p.add_argument("--heap-threshold-mib", type=float, default=d.heap_threshold_mib)
    p.add_argument("--tensor-threshold-kib", type=float, default=d.tensor_threshold_kib)
    p.add_argument("--frontends", nargs="+", choices=FRONTENDS, default=list(FRONTENDS))
    p.add_argument("--json", help="write the traces and verdicts here")
    a = p.parse_args(argv)
    if a.steps <= a.warmup:
        p.error(f"--steps ({a.steps}) must exceed --warmup ({a.warmup})")
    cfg = SoakConfig(
        world_size=a.world_size,
        preset=a.preset,
        batch=a.batch,
        seq=a.seq,
        steps=a.steps,
        warmup=a.warmup,
        ckpt_every=a.ckpt_every,
        sample_every=a.sample_every,
        rss_threshold_mib=a.rss_threshold_mib,
        heap_threshold_mib=a.heap_threshold_mib,
        tensor_threshold_kib=a.tensor_threshold_kib,
        frontends=tuple(a.frontends),
    )
    return cfg, a.json


def main(argv: list[str] | None = None) -> int:
    """Soak every front end; print the table and verdicts; 0 if all are flat, else 1.

    With ``--faults``, the soak under faults instead (``soak_faults.py``).
    """
    if "--faults" in (sys.argv[1:] if argv is None else argv):
        from soak_faults import main as fault_soak

        return fault_soak(argv)
    cfg, json_out = _parse(argv)
    results: dict[str, list[RankTrace]] = {}
    wall: dict[str, float] = {}
    for frontend in cfg.frontends:
        began = time.perf_counter()
        results[frontend] = _run(frontend, cfg)
        wall[frontend] = time.perf_counter() - began
    print(report(cfg, results, wall))
    verdicts = [analyse(f, t, cfg) for f, traces in results.items() for t in traces]
    if json_out:
        data = {
            "config": asdict(cfg),
            "wall_s": wall,
            "verdicts": [asdict(v) for v in verdicts],
            "traces": {f: [asdict(t) for t in traces] for f, traces in results.items()},
        }
        with open(json_out, "w", encoding="utf-8") as file:
            json.dump(data, file)
    return 1 if any(v.grew for v in verdicts) else 0


if __name__ == "__main__":
    raise SystemExit(main())
