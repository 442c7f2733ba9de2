"""Where resident memory goes, phase by phase: shard's FSDP side by side with PyTorch's.

Why: ``bench_train.py`` reports one number per rank, the peak RSS (``ru_maxrss``),
which says *that* one implementation holds more than another but not *where*:
the interpreter's and torch's pages, the allocator's free pages, parameters,
gradients, optimizer state, buffers an engine keeps between steps, autograd's
saved activations. This script trains ``bench_train``'s GPT under each FSDP
implementation (``--impls``; each in its own freshly spawned gloo ranks, with
``bench_train``'s model, data, threads and wrapping) and records, per rank:

- phases (default): a snapshot after the imports, the process group, the
  model, the sharding, the optimizer, then after each forward, backward and
  optimizer step of the first ``--steps`` steps;
- ``--timeline``: instead, RSS and heap at every block boundary of every
  step (forward: each block's start and end; backward: when a block's output
  gradient arrives and when its input gradient is computed), cheap enough to
  run ``bench_train``'s 15 steps; with ``--scan-step N`` also the live
  tensors at every point of step N, diffed between shard and PyTorch;
- ``--op-peaks``: the heap's peak inside each forward, backward and
  optimizer step, read after every operation torch dispatches (a
  ``TorchDispatchMode``), over the step's start, and the operation and
  engine frame where it was reached. Block boundaries miss what a unit holds
  for a moment between them (its full parameters while its reduction's
  input is built was one: [Note: free, then reduce] in ``_state.py``).

``--precision bf16`` runs forward and loss under ``torch.autocast`` and gives
each implementation ``bench_train``'s bf16 mixed-precision policy.

It prints one table per figure, the implementations side by side and
``shard - torch`` for each pair, and (``--json``) everything;
``--from-json`` prints the report of an earlier run.

Run from the repository root (``bench_train.py``'s standing configuration)::

    .venv/bin/python tools/bench/memory_profile.py --world-size 2 --layers 4 \\
        --d-model 256 --heads 4 --seq 128 --batch 8 --steps 5
    .venv/bin/python tools/bench/memory_profile.py --timeline --steps 15 --scan-step 3
    .venv/bin/python tools/bench/memory_profile.py --op-peaks --precision bf16 --layers 4 \
        --d-model 512 --heads 8 --seq 128 --batch 4 --steps 3

[Note: what a snapshot holds]
- ``rss``, ``anon``, ``file``: ``/proc/self/status``'s ``VmRSS``, ``RssAnon``
  (heap, thread stacks, Python's arenas) and ``RssFile`` (pages of the shared
  libraries: torch's kernels are paged in the first time they run); ``hwm``:
  ``VmHWM``, the peak RSS so far (``bench_train``'s figure).
- ``heap`` (glibc's ``mallinfo2``, every arena): ``in_use`` (``uordblks +
  hblkhd``: every live allocation, tensors included) and ``free``
  (``fordblks``: freed chunks the allocator keeps; resident once they were
  touched, so RSS counts them although nothing uses them).
- ``tensors`` (phases only): after ``gc.collect()``, the bytes of the distinct
  storages of every tensor Python reaches (``gc.get_objects()``; a DTensor's
  local tensor, a storage shared by views once), by category: ``params``
  (the registered parameters' storages, padding included), ``grads``,
  ``optim`` (optimizer state), ``comm cache`` (free buffers of shard-comms'
  staging cache) and ``other`` (everything else: full parameters kept, the
  batch, and autograd's saved activations, whose Python objects outlive
  their last Python reference while autograd holds them). Tensors only C++
  holds (gloo's staging inside a collective, autograd's gradients before they
  are accumulated) are not seen: ``heap in_use`` minus the tensors is those
  plus torch's and Python's own allocations.
- ``arenas`` (end of the run): glibc's ``malloc_info`` per arena, the bytes
  it has from the system and how many of them are free.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import importlib
import json
import os
import re
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import _FSDP_NAMESPACES, FLAT_IMPLS, PAIRS, QUANT_IMPLS, _wrap
from soak import MallInfo2
from spawn import run_ranks

from shard_cli.gpt import GPT, Block, GPTConfig, synthetic_tokens

# Every FSDP implementation of bench_train but the quantized ones (whose traffic is not what
# this profiles); the four plain ones by default.
_NAMESPACES = {k: v for k, v in _FSDP_NAMESPACES.items() if k not in QUANT_IMPLS}
_DEFAULT_IMPLS = ("torch_fsdp", "torch_fsdp1", "shard_fsdp", "shard_fsdp1")
CATEGORIES = ("params", "grads", "optim", "comm cache", "other")
Point = tuple[int, str, int, int, int]  # step, label, rss, heap in use, heap free


# ---------------------------------------------------------------------- readings


def _heap_reader() -> Callable[[], tuple[int, int]]:
    """``mallinfo2()`` as (bytes in use, bytes free), or zeros without glibc."""
    try:
        call = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return lambda: (0, 0)
    call.restype = MallInfo2

    def read() -> tuple[int, int]:
        info = call()
        return int(info.uordblks + info.hblkhd), int(info.fordblks)

    return read


_HEAP = _heap_reader()
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _status() -> dict[str, int]:
    wanted = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "VmHWM": "hwm"}
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in wanted:
                out[wanted[key]] = int(value.split()[0]) * 1024
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _malloc_arenas() -> list[dict[str, int]]:
    """glibc's ``malloc_info``: per arena, bytes from the system and bytes free."""
    try:
        libc = ctypes.CDLL(None)
        libc.open_memstream.restype = ctypes.c_void_p
        libc.fclose.argtypes = [ctypes.c_void_p]
        libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.free.argtypes = [ctypes.c_void_p]
    except (OSError, AttributeError):
        return []
    buf = ctypes.c_void_p()
    size = ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    text = ctypes.string_at(buf, size.value).decode()
    libc.free(buf)
    arenas = []
    for number, body in re.findall(r'<heap nr="(\d+)">(.*?)</heap>', text, re.S):
        free = re.search(r'<total type="rest" count="\d+" size="(\d+)"', body)
        system = re.search(r'<system type="current" size="(\d+)"', body)
        arenas.append(
            {
                "nr": int(number),
                "free": int(free.group(1)) if free else 0,
                "system": int(system.group(1)) if system else 0,
            }
        )
    return arenas


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of ``t``'s storage (a DTensor's local one), or ``None``."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    if t.is_meta:
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # no storage (sparse, some wrappers)
        return None
    return (storage.data_ptr(), storage.nbytes()) if storage.data_ptr() else None


def _live_tensors() -> dict[int, tuple[int, str]]:
    """Every storage Python reaches: pointer -> (bytes, shape and dtype of a tensor on it)."""
    gc.collect()
    found: dict[int, tuple[int, str]] = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): the latter reads __class__, which some proxies warn on.
        if not issubclass(type(obj), torch.Tensor):
            continue
        assert isinstance(obj, torch.Tensor)
        key = _storage_key(obj)
        if key is not None and key[0] not in found:
            dtype = str(obj.dtype).removeprefix("torch.")
            found[key[0]] = (key[1], f"{tuple(obj.shape)} {dtype}")
    return found


def _tensor_bytes(model: nn.Module | None, optim: torch.optim.Optimizer | None) -> dict[str, int]:
    """Live storage bytes by category; see [Note: what a snapshot holds]."""
    known: dict[int, str] = {}

    def mark(t: object, category: str) -> None:
        if isinstance(t, torch.Tensor):
            key = _storage_key(t)
            if key is not None:
                known.setdefault(key[0], category)

    if model is not None:
        for p in model.parameters():
            mark(p, "params")
            mark(p.grad, "grads")
    if optim is not None:
        for state in optim.state.values():
            for value in state.values():
                mark(value, "optim")
    buffers = sys.modules.get("shard_comms._buffers")
    if buffers is not None and buffers._CACHE is not None:
        for free in buffers._CACHE._free.values():
            for buffer in free:
                mark(buffer, "comm cache")
    totals = dict.fromkeys(CATEGORIES, 0)
    for ptr, (nbytes, _) in _live_tensors().items():
        totals[known.get(ptr, "other")] += nbytes
    return totals


# ---------------------------------------------------------------------- rank side


@dataclass(frozen=True)
class ProfileConfig:
    """One invocation; the model and data are ``bench_train``'s."""

    model: GPTConfig
    world_size: int
    batch: int
    steps: int
    threads: int
    seed: int
    lr: float
    timeline: bool
    scan_step: int
    op_peaks: bool = False
    bf16: bool = False


class _OpPeaks(TorchDispatchMode):
    """The heap in use after every dispatched operation: its peak per phase, and where."""

    def __init__(self) -> None:
        super().__init__()
        self.peaks: list[tuple[int, str, int, str]] = []  # step, phase, over start, where
        self._peak = 0
        self._where = ""

    @contextmanager
    def phase(self, step: int, name: str) -> Iterator[None]:
        start = _HEAP()[0]
        self._peak, self._where = start, "(start)"
        with self:
            yield
        self.peaks.append((step, name, self._peak - start, self._where))

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        in_use = _HEAP()[0]
        if in_use > self._peak:
            self._peak = in_use
            engine = [
                f"{Path(f.filename).name}:{f.lineno} {f.name}"
                for f in traceback.extract_stack()
                if "shard_runtime" in f.filename or "fsdp" in f.filename
            ]
            self._where = f"{func} in {engine[-1] if engine else 'autograd'}"
        return out


class _Timeline:
    """RSS and heap at every block boundary; the live tensors at each point of one step."""

    def __init__(self, scan_step: int) -> None:
        self.step = 0
        self.points: list[Point] = []
        self.scans: dict[str, list[tuple[int, str]]] = {}
        self._scan_step = scan_step

    def mark(self, label: str) -> None:
        self.points.append((self.step, label, _rss(), *_HEAP()))
        if self.step == self._scan_step:
            self.scans[label] = sorted(_live_tensors().values(), reverse=True)

    def attach(self, model: nn.Module) -> None:
        blocks = [m for m in model.modules() if isinstance(m, Block)]
        for index, block in enumerate(blocks):
            self._hook_block(block, f"block {index}")

    def _hook_block(self, block: nn.Module, name: str) -> None:
        def on_grad(label: str) -> Callable[[torch.Tensor], None]:
            return lambda grad: self.mark(label)

        def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
            self.mark(f"fwd {name} start")
            x = args[0]
            if isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(on_grad(f"bwd {name} done"))  # type: ignore[no-untyped-call]

        def post(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            self.mark(f"fwd {name} end")
            if out.requires_grad:
                out.register_hook(on_grad(f"bwd {name} start"))  # type: ignore[no-untyped-call]

        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)


def _snapshot(
    phase: str, model: nn.Module | None = None, optim: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    in_use, free = _HEAP()
    tensors = _tensor_bytes(model, optim)
    return {"phase": phase, **_status(), "in_use": in_use, "free": free, "tensors": tensors}


def _rank_main(rank: int, impl: str, cfg: ProfileConfig, init_file: str, queue: Any) -> None:
    phases = not cfg.timeline
    snaps = [_snapshot("process start")]
    torch.set_num_threads(cfg.threads)
    importlib.import_module(_NAMESPACES[impl])
    if impl in FLAT_IMPLS:
        importlib.import_module(f"{_NAMESPACES[impl]}.wrap")
    snaps.append(_snapshot("import"))
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=cfg.world_size
    )
    mesh = init_device_mesh("cpu", (cfg.world_size,))
    snaps.append(_snapshot("process group"))
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    snaps.append(_snapshot("model built", model))
    model = _wrap(impl, model, mesh, torch.device("cpu"), cfg.bf16)
    snaps.append(_snapshot("sharded", model))
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1)
    snaps.append(_snapshot("optimizer built", model, optim))
    timeline = _Timeline(cfg.scan_step) if cfg.timeline else None
    peaks = _OpPeaks() if cfg.op_peaks else None

    def measured(step: int, name: str) -> Any:
        return nullcontext() if peaks is None else peaks.phase(step, name)

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16)
    if timeline is not None:
        timeline.attach(model)
    rows = slice(rank * cfg.batch, (rank + 1) * cfg.batch)
    losses: list[float] = []
    for step in range(1, cfg.steps + 1):
        tokens = synthetic_tokens(
            cfg.model, cfg.world_size * cfg.batch, seed=cfg.seed, step=step - 1
        )[rows]
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        dist.barrier()
        optim.zero_grad(set_to_none=True)
        if timeline is not None:
            timeline.step = step
            timeline.mark("step start")
        with measured(step, "forward"), autocast:
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        if timeline is not None:
            timeline.mark("loss")
        if phases:
            snaps.append(_snapshot(f"{step} forward", model, optim))
        with measured(step, "backward"):
            loss.backward()  # type: ignore[no-untyped-call]
        if timeline is not None:
            timeline.mark("backward end")
        if phases:
            snaps.append(_snapshot(f"{step} backward", model, optim))
        with measured(step, "optimizer"):
            optim.step()
        losses.append(loss.item())
        del logits, loss
        if timeline is not None:
            timeline.mark("optimizer end")
        if phases:
            snaps.append(_snapshot(f"{step} optimizer", model, optim))
    if not phases:
        snaps.append(_snapshot(f"after {cfg.steps} steps", model, optim))
    dist.barrier()
    queue.put(
        {
            "rank": rank,
            "snapshots": snaps,
            "losses": losses,
            "timeline": [] if timeline is None else timeline.points,
            "scans": {} if timeline is None else timeline.scans,
            "op_peaks": [] if peaks is None else peaks.peaks,
            "arenas": _malloc_arenas(),
        }
    )
    dist.destroy_process_group()


def _run(impl: str, cfg: ProfileConfig) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        results = run_ranks(impl, cfg.world_size, _rank_main, lambda r, q: (r, impl, cfg, init, q))
    return sorted(results, key=lambda r: r["rank"])


# ---------------------------------------------------------------------- report


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _pairs(runs: dict[str, Any]) -> list[tuple[str, str]]:
    return [(s, t) for s, t in PAIRS if s in runs and t in runs]


def _phase_table(
    title: str, runs: dict[str, Any], value: Callable[[dict[str, Any]], float]
) -> list[str]:
    """Rank 0's ``value`` per phase, one column per implementation, then shard - torch."""
    impls = list(runs)
    pairs = _pairs(runs)
    lines = [
        f"{title:<20}"
        + "".join(f"{name:>13}" for name in impls)
        + "".join(f"{s.removeprefix('shard_') + ' diff':>13}" for s, _ in pairs)
    ]
    for index, snap in enumerate(runs[impls[0]][0]["snapshots"]):
        row = {name: value(runs[name][0]["snapshots"][index]) for name in impls}
        lines.append(
            f"{snap['phase']:<20}"
            + "".join(f"{_mib(row[name]):>13}" for name in impls)
            + "".join(f"{(row[s] - row[t]) / 2**20:>+13.1f}" for s, t in pairs)
        )
    return lines


def _timeline_report(runs: dict[str, Any]) -> list[str]:
    """Per step the largest RSS and heap in use; the last step point by point."""
    impls = list(runs)
    lines = ["timeline, rank 0: per step, the largest RSS / heap in use at a block boundary"]
    steps = sorted({p[0] for p in runs[impls[0]][0]["timeline"]})
    lines.append(f"{'step':<6}" + "".join(f"{name:>24}" for name in impls))
    for step in steps:
        row = f"{step:<6}"
        for name in impls:
            points = [p for p in runs[name][0]["timeline"] if p[0] == step]
            figure = f"{_mib(max(p[2] for p in points))} / {_mib(max(p[3] for p in points))}"
            row += f"{figure:>24}"
        lines.append(row)
    last = steps[-1]
    lines += ["", f"step {last}, rank 0: RSS / heap in use / heap free at each point"]
    lines.append(f"{'point':<20}" + "".join(f"{name:>24}" for name in impls))
    per_impl = {name: [p for p in runs[name][0]["timeline"] if p[0] == last] for name in impls}
    labels = [p[1] for p in per_impl[impls[0]]]
    for label in labels:
        row = f"{label:<20}"
        for name in impls:
            match = [p for p in per_impl[name] if p[1] == label]
            figure = "/".join(_mib(x) for x in match[0][2:]) if match else "-"
            row += f"{figure:>24}"
        lines.append(row)
    return lines


def _scan_report(runs: dict[str, Any]) -> list[str]:
    """Per point of the scanned step: live tensor bytes, and the tensors only one side holds."""
    lines: list[str] = []
    for shard, torch_name in _pairs(runs):
        a_scans = runs[torch_name][0]["scans"]
        b_scans = runs[shard][0]["scans"]
        if not a_scans or not b_scans:
            continue
        lines += ["", f"live tensors Python reaches, rank 0, {shard} vs {torch_name}:"]
        for label in a_scans:
            if label not in b_scans:
                continue
            a = collections.Counter(tuple(x) for x in a_scans[label])
            b = collections.Counter(tuple(x) for x in b_scans[label])
            total_a = sum(n * c for (n, _), c in a.items())
            total_b = sum(n * c for (n, _), c in b.items())
            lines.append(
                f"  {label:<20} torch {_mib(total_a):>7} shard {_mib(total_b):>7} "
                f"diff {(total_b - total_a) / 2**20:+.2f}"
            )
            # Shapes differ where the two keep the same bytes in another form (a padded
            # shard's storage vs its local view), so only sizes are compared.
            by_size_a = collections.Counter(n for (n, _), c in a.items() for _ in range(c))
            by_size_b = collections.Counter(n for (n, _), c in b.items() for _ in range(c))
            extra = by_size_b - by_size_a
            missing = by_size_a - by_size_b
            for side, only, held in (("shard", extra, b), ("torch", missing, a)):
                if only:
                    shapes = {n: what for (n, what) in held}
                    lines.append(
                        f"      {side} only: "
                        + ", ".join(f"{c} x {_mib(n)} MiB {shapes[n]}" for n, c in only.items())
                    )
    return lines


def _phase_peak(ranks: list[dict[str, Any]], step: int, phase: str) -> list[Any]:
    """The largest rank's ``--op-peaks`` record of ``phase`` in ``step``."""
    found = [p for r in ranks for p in r["op_peaks"] if (p[0], p[1]) == (step, phase)]
    return max(found, key=lambda p: p[2])


def _op_peaks_report(runs: dict[str, Any]) -> list[str]:
    """Each phase's heap peak over its start in the last step, the largest rank's, and where."""
    impls = list(runs)
    phases = ("forward", "backward", "optimizer")
    last = max(p[0] for p in runs[impls[0]][0]["op_peaks"])
    top = {(n, phase): _phase_peak(runs[n], last, phase) for n in impls for phase in phases}
    lines = [f"heap peak over the phase's start, step {last}, the largest rank (--op-peaks)"]
    lines.append(f"{'phase':<12}" + "".join(f"{name:>14}" for name in impls))
    for phase in phases:
        lines.append(f"{phase:<12}" + "".join(f"{_mib(top[name, phase][2]):>14}" for name in impls))
    for shard, torch_name in _pairs(runs):
        for phase in phases:
            diff = top[shard, phase][2] - top[torch_name, phase][2]
            lines.append(f"  diff {shard} - {torch_name} {phase}: {_mib(diff)}")
    lines.append("where each peak was reached:")
    for phase in phases:
        lines += [f"  {phase} {name}: {top[name, phase][3]}" for name in impls]
    return lines


def report(runs: dict[str, Any]) -> str:
    """The tables of one run (``runs``: implementation -> its ranks' records)."""
    timeline = bool(runs[next(iter(runs))][0]["timeline"])
    lines = ["MiB, rank 0 (every rank in the JSON); diff = shard - torch", ""]
    figures: list[tuple[str, Callable[[dict[str, Any]], float]]] = [
        ("peak RSS (VmHWM)", lambda s: s["hwm"]),
        ("RSS", lambda s: s["rss"]),
        ("RSS anon", lambda s: s["anon"]),
        ("RSS file", lambda s: s["file"]),
        ("heap in use", lambda s: s["in_use"]),
        ("heap free", lambda s: s["free"]),
        ("tensors (all)", lambda s: sum(s["tensors"].values())),
    ]
    figures += [(f"tensors: {c}", lambda s, c=c: s["tensors"][c]) for c in CATEGORIES]
    for title, value in figures:
        lines += _phase_table(title, runs, value)
        lines.append("")
    if timeline:
        lines += _timeline_report(runs)
        lines += _scan_report(runs)
        lines.append("")
    if runs[next(iter(runs))][0].get("op_peaks"):
        lines += _op_peaks_report(runs)
        lines.append("")
    lines.append("glibc arenas at the end, rank 0: MiB from the system / free")
    for name, ranks in runs.items():
        arenas = [a for a in ranks[0]["arenas"] if a["system"]]
        lines.append(
            f"  {name:<12} "
            + ", ".join(f"#{a['nr']} {_mib(a['system'])}/{_mib(a['free'])}" for a in arenas)
        )
    lines.append("")
    lines.append(
        "peak RSS per rank at the end: "
        + ", ".join(
            f"{name} " + "/".join(_mib(r["snapshots"][-1]["hwm"]) for r in ranks)
            for name, ranks in runs.items()
        )
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Profile, print the report, and exit 1 if the implementations' losses differ."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--mlp-ratio", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=None, help="default cores // world")
    # The quantized implementations need bench_train's --comm-quant: profile those there.
    parser.add_argument("--impls", default=",".join(_DEFAULT_IMPLS))
    parser.add_argument(
        "--timeline", action="store_true", help="RSS and heap at every block boundary"
    )
    parser.add_argument(
        "--scan-step", type=int, default=0, help="with --timeline: live tensors in this step"
    )
    parser.add_argument(
        "--op-peaks", action="store_true", help="each phase's heap peak, read after every op"
    )
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--json", default=None, help="write every record to this file")
    parser.add_argument("--from-json", default=None, help="report an earlier --json and exit")
    args = parser.parse_args(argv)
    if args.from_json:
        print(report(json.loads(Path(args.from_json).read_text())["runs"]))
        return 0
    impls = [name.strip() for name in args.impls.split(",") if name.strip()]
    unknown = [name for name in impls if name not in _NAMESPACES]
    if unknown or not impls:
        parser.error(f"--impls: unknown {unknown or impls}; choose from {', '.join(_NAMESPACES)}")
    cfg = ProfileConfig(
        model=GPTConfig(
            vocab_size=args.vocab,
            d_model=args.d_model,
            n_heads=args.heads,
            n_layers=args.layers,
            seq_len=args.seq,
            mlp_ratio=args.mlp_ratio,
        ),
        world_size=args.world_size,
        batch=args.batch,
        steps=args.steps,
        threads=args.threads or max(1, (os.cpu_count() or 1) // args.world_size),
        seed=args.seed,
        lr=args.lr,
        timeline=args.timeline,
        scan_step=args.scan_step,
        op_peaks=args.op_peaks,
        bf16=args.precision == "bf16",
    )
    load = os.getloadavg()[0]
    runs = {impl: _run(impl, cfg) for impl in impls}
    if args.json:
        record = {"config": asdict(cfg), "argv": sys.argv, "runs": runs}
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    print(report(runs))
    print(f"\nload average {load:.2f} -> {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    losses = {name: [r["losses"] for r in ranks] for name, ranks in runs.items()}
    if len({json.dumps(v) for v in losses.values()}) > 1:
        print("losses differ between implementations", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
