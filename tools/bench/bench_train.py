"""Training benchmark: shard's ``fully_shard`` and wrapper side by side with PyTorch's.

Why: ``shard_runtime.fully_shard`` is meant as a drop-in for PyTorch's
``fully_shard`` (FSDP2), and ``shard_runtime.FullyShardedDataParallel`` for
PyTorch's wrapper (FSDP1), so their speed and memory are only meaningful as
ratios against PyTorch's measured in the same run, on the same model, data
and machine. This script trains :class:`gpt.GPT` on synthetic tokens six ways
(``--impls`` picks a subset):

- ``single``: one process over the whole global batch (the loss reference);
- ``ddp``: ``DistributedDataParallel``, every rank a full replica;
- ``torch_fsdp``: PyTorch ``fully_shard`` on every block, then the root;
- ``shard_fsdp``: shard ``fully_shard``, applied the same way;
- ``torch_fsdp1``: PyTorch ``FullyShardedDataParallel`` around the root,
  FULL_SHARD, ``auto_wrap_policy=ModuleWrapPolicy({Block})``,
  ``use_orig_params=False`` (one flat parameter per block, one for the root);
- ``shard_fsdp1``: shard ``FullyShardedDataParallel``, the same arguments;
- ``shard_fsdp_quant`` / ``shard_fsdp1_quant`` (not in the default set):
  ``shard_fsdp`` / ``shard_fsdp1`` with quantized communication,
  ``set_comm_codec`` as ``--comm-quant`` says (default ``weights,grads``:
  shard-comm-quant's int8 all-gathers and int8 reductions with error
  feedback); their losses differ from ``single``'s by the quantization, so
  they are held to ``--quant-loss-rtol`` instead of ``--loss-rtol``;
- ``shard_fsdp_release`` / ``shard_fsdp1_release`` (not in the default set):
  ``shard_fsdp`` / ``shard_fsdp1`` with
  ``set_release_host_memory_after_backward(True)``: the heap glibc keeps
  from each step's frees goes back to the OS at the end of every backward
  (see [Note: host memory the allocator keeps] in shard-runtime);

each in its own freshly spawned processes (gloo, ``torch.set_num_threads(
cores // world_size)`` in every process, ``single``'s included), so one
implementation's peak RSS never includes another's. Every rank trains on its
own slice of the same global batches, and ``single`` on the concatenation,
so every implementation must produce the same losses.

Run from the repository root::

    .venv/bin/python tools/bench/bench_train.py --world-size 2 --layers 4 \\
        --d-model 256 --heads 4 --seq 128 --batch 8 --steps 12 --warmup 3 --repeat 2

On a GPU (``tools/gpu/check.sh`` runs this), one rank against the plain model::

    .venv/bin/python tools/bench/bench_train.py --world-size 1 --device cuda \\
        --precision bf16 --impls single,shard_fsdp,torch_fsdp,shard_fsdp1,torch_fsdp1

[Note: what is measured]
- step time: forward + loss + backward + optimizer step, timed with
  ``time.perf_counter`` after a barrier; a step's time is the slowest rank's,
  and the reported figure is the median over the post-warmup steps. With
  ``--repeat R`` every implementation runs R times in ABBA order and the
  figure is the lowest of the R medians: on a shared machine a repeat either
  runs undisturbed (wall time close to CPU time) or waits for the
  neighbours' processes, and only the undisturbed ones compare the code.
- cpu time: ``time.process_time`` of a step (every thread of the rank,
  gloo's included), slowest rank, median; steady under load.
- phases: wall time of forward + loss, of backward, of the optimizer step.
- tokens/s: global tokens per step (``world_size * batch * seq``) / step time.
- peak RSS: ``ru_maxrss`` of each rank process (KiB on Linux), which includes
  the interpreter and torch itself; ``base`` is the same figure taken just
  before the model is built, so ``peak - base`` is what training added.
- resident state: bytes of the local tensors (``DTensor.to_local()``) of the
  parameters, their ``.grad`` and the optimizer state after the last step;
  for the wrappers, ``model.parameters()`` are the flat shards and the
  grads and optimizer state are theirs. Full state / N is computed from the
  model's shapes on the meta device. The JSON also holds the bytes of the
  storages behind them (padding included) and whether every parameter had
  the sharded form (a DTensor for ``fully_shard``, a 1-D ``_flat_param``
  for the wrappers; the report warns if a sharded implementation left one
  unsharded).
- final loss: the last step's loss, averaged over ranks.
- wire bytes: bytes per step of the collectives each rank issues in the
  timed steps, by kind, in shard's convention (the unsharded buffer: an
  all-gather's output, a reduce-scatter's input, an all-reduce's tensor):
  shard's own counters (``count_collectives``) for shard's implementations,
  and for PyTorch's the same convention counted around
  ``torch.distributed``'s calls (``_TorchCommCounter``). A ratio of these
  is a ratio of bytes on the wire. ``ddp`` reduces in C++ and is not counted.

[Note: device and precision]
``--device cuda`` puts rank r on ``cuda:r`` with NCCL (``--world-size`` at
most the GPUs visible); the model is built on the CPU from the seed, as on
the CPU path, then moved, so every implementation starts from the same
weights. Timing synchronizes the device at every phase boundary (CUDA runs
asynchronously), and each rank also records ``torch.cuda``'s peak allocated
bytes (``max_memory_allocated``, from just before the model is built).
``--precision bf16`` is bf16 compute with fp32 weights and optimizer state:
every implementation runs forward and loss under ``torch.autocast(bf16)``
(the plain model's usual mixed precision), and the four FSDP ones also get
their mixed-precision policy (``param_dtype=bf16, reduce_dtype=fp32``;
``MixedPrecisionPolicy`` for ``fully_shard``, ``MixedPrecision`` for the
wrappers, PyTorch's and shard's alike), so they gather parameters in bf16 as
a bf16 FSDP job does. Their losses then differ from ``single``'s by more
than rounding: on an H200, 2.7% at one step of 20 and 1.4% at the last (the
plain model multiplies bf16 copies of fp32 weights made per operation, the
FSDP ones bf16 weights gathered once). So in bf16 the losses are compared
with PyTorch's FSDP (``torch_fsdp``, else ``torch_fsdp1``), within the
looser default ``--loss-rtol``, and ``single``'s are reported, not judged. At
``--world-size 1`` every implementation but ``single`` still runs in a
process group of one, so the ratios against ``single`` are the cost of the
sharding machinery itself.

[Note: profiling]
``--profile`` profiles rank 0 of the four sharded implementations over
the post-warmup steps and writes the profiles and a text summary (self time
grouped by origin: engine Python, DTensor, collectives, copies, compute)
under ``--profile-dir``. ``cprofile`` clocks wall time (waits included),
``cprofile-cpu`` the main thread's CPU time (what the rank itself spends,
steady on a loaded machine), ``torch`` runs ``torch.profiler`` (per-op table
and a Chrome trace). Profiled step times are inflated and marked as such.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import inspect
import io
import json
import os
import platform
import pstats
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from shard_cli._comm_quant import apply_comm_quant, parse_comm_quant
from shard_cli.gpt import GPT, Block, GPTConfig, synthetic_tokens
from shard_comms import CommCounts, count_collectives

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import run_ranks

DEFAULT_IMPLS = ("single", "ddp", "torch_fsdp", "shard_fsdp", "torch_fsdp1", "shard_fsdp1")
QUANT_IMPLS = ("shard_fsdp_quant", "shard_fsdp1_quant")
RELEASE_IMPLS = ("shard_fsdp_release", "shard_fsdp1_release")
IMPLS = (*DEFAULT_IMPLS, *QUANT_IMPLS, *RELEASE_IMPLS)
FSDP_IMPLS = (
    "torch_fsdp",
    "shard_fsdp",
    "torch_fsdp1",
    "shard_fsdp1",
    *QUANT_IMPLS,
    *RELEASE_IMPLS,
)
FLAT_IMPLS = ("torch_fsdp1", "shard_fsdp1", "shard_fsdp1_quant", "shard_fsdp1_release")
TORCH_IMPLS = ("torch_fsdp", "torch_fsdp1")
# Where each FSDP implementation's names live (its ``wrap`` policies in ``<namespace>.wrap``).
_FSDP_NAMESPACES = {
    "torch_fsdp": "torch.distributed.fsdp",
    "shard_fsdp": "shard_runtime",
    "torch_fsdp1": "torch.distributed.fsdp",
    "shard_fsdp1": "shard_runtime",
    "shard_fsdp_quant": "shard_runtime",
    "shard_fsdp1_quant": "shard_runtime",
    "shard_fsdp_release": "shard_runtime",
    "shard_fsdp1_release": "shard_runtime",
}
# (shard's implementation, PyTorch's it is measured against); ratios are taken
# against every reference present, targets for every shard implementation.
PAIRS = (
    ("shard_fsdp", "torch_fsdp"),
    ("shard_fsdp1", "torch_fsdp1"),
    ("shard_fsdp_quant", "torch_fsdp"),
    ("shard_fsdp1_quant", "torch_fsdp1"),
    ("shard_fsdp_release", "torch_fsdp"),
    ("shard_fsdp1_release", "torch_fsdp1"),
)
QUANT_LOSS_RTOL = 2e-2  # quantized communication: see the module docstring
WIRE_BYTES_TARGET = 0.30  # issue #27: quantized bytes on the wire at most 0.3x PyTorch's fp32
PHASES = ("forward", "backward", "optimizer")
PROFILERS = ("cprofile", "cprofile-cpu", "torch")
FP32_LOSS_RTOL = 1e-4
BF16_LOSS_RTOL = 2e-2  # bf16 parameters vs autocast: see [Note: device and precision]
STEP_TIME_TARGET = 1.00
STEP_TIME_AIM = 0.90
STATE_TOLERANCE = 1e-3


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark invocation.

    Attributes:
        model: sizes of the GPT.
        world_size: ranks of every distributed implementation.
        batch: sequences per rank per step (``single`` runs ``world_size * batch``).
        steps: timed steps after warmup.
        warmup: untimed steps first.
        lr: AdamW learning rate.
        seed: seed of the model init and of the synthetic data.
        threads: ``torch.set_num_threads`` of every rank process (``single``'s too,
            so it does ``world_size`` ranks' work with one rank's cores).
        profile: ``None`` or one of ``PROFILERS``; see [Note: profiling].
        profile_dir: where profiles go.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, rank r on ``cuda:r``); see
            [Note: device and precision].
        precision: ``"fp32"``, or ``"bf16"`` compute; see [Note: device and precision].
        comm_quant: what the ``*_quant`` implementations quantize (``shard train
            --comm-quant``'s syntax: ``weights,grads``, ``grads=int4``...).
    """

    model: GPTConfig
    world_size: int
    batch: int
    steps: int
    warmup: int
    lr: float
    seed: int
    threads: int
    profile: str | None = None
    profile_dir: str = "runs/bench_train_profile"
    device: str = "cpu"
    precision: str = "fp32"
    comm_quant: str = "weights,grads"

    @property
    def global_batch(self) -> int:
        """Sequences per step across all ranks."""
        return self.world_size * self.batch


@dataclass
class RankResult:
    """What one rank measured; see [Note: what is measured]."""

    rank: int
    threads: int
    step_times: list[float]
    step_cpu_times: list[float]
    phase_times: dict[str, list[float]]  # "forward", "backward", "optimizer": wall seconds
    losses: list[float]
    peak_rss: int
    base_rss: int
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    storage_bytes: int
    all_sharded: bool
    profiled: bool
    peak_cuda_bytes: int = 0  # torch.cuda.max_memory_allocated; 0 on the CPU
    wire_bytes: dict[str, float] = field(default_factory=dict)  # per timed step, by kind

    @property
    def state_bytes(self) -> int:
        """Parameter + gradient + optimizer state bytes resident on this rank."""
        return self.param_bytes + self.grad_bytes + self.optim_bytes


def _slowest_rank(per_rank: list[list[float]]) -> list[float]:
    """Step by step, the largest value over ranks."""
    return [max(values) for values in zip(*per_rank, strict=True)]


@dataclass
class ImplResult:
    """One implementation, aggregated over its ranks and repeats.

    A step's time is its slowest rank's. Timing figures come from the *best
    repeat*, the one with the lowest median step time: on a shared machine the
    other repeats measure the neighbours' load (see [Note: what is measured]).
    ``ranks`` is the first repeat's ranks (losses and resident state are the
    same in every repeat; the analysis checks the losses); peak RSS is the
    largest over repeats.
    """

    impl: str
    runs: list[list[RankResult]]
    global_tokens: int
    run_medians: list[float] = field(init=False)
    best: list[RankResult] = field(init=False)
    losses: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.run_medians = [
            statistics.median(_slowest_rank([r.step_times for r in ranks])) for ranks in self.runs
        ]
        self.best = self.runs[self.run_medians.index(min(self.run_medians))]
        self.losses = [
            statistics.fmean(values) for values in zip(*(r.losses for r in self.ranks), strict=True)
        ]

    @property
    def ranks(self) -> list[RankResult]:
        """The first repeat's ranks."""
        return self.runs[0]

    @property
    def median_step_s(self) -> float:
        """Median step time of the best repeat."""
        return min(self.run_medians)

    @property
    def pooled_median_step_s(self) -> float:
        """Median step time over every timed step of every repeat."""
        pooled: list[float] = []
        for ranks in self.runs:
            pooled += _slowest_rank([r.step_times for r in ranks])
        return statistics.median(pooled)

    @property
    def median_cpu_s(self) -> float:
        """Median over the best repeat's steps of the largest per-rank process CPU time."""
        return statistics.median(_slowest_rank([r.step_cpu_times for r in self.best]))

    def median_phase_s(self, phase: str) -> float:
        """Median over the best repeat's steps of the slowest rank's wall time in ``phase``."""
        return statistics.median(_slowest_rank([r.phase_times[phase] for r in self.best]))

    @property
    def tokens_per_s(self) -> float:
        """Global tokens per second at the median step time."""
        return self.global_tokens / self.median_step_s

    @property
    def final_loss(self) -> float:
        """Last step's loss, mean over ranks."""
        return self.losses[-1]

    @property
    def peak_rss_per_rank(self) -> list[int]:
        """Each rank's largest peak RSS over repeats."""
        return [max(ranks[i].peak_rss for ranks in self.runs) for i in range(len(self.ranks))]

    @property
    def peak_rss_over_base_per_rank(self) -> list[int]:
        """Each rank's largest ``peak - base`` RSS over repeats."""
        return [
            max(ranks[i].peak_rss - ranks[i].base_rss for ranks in self.runs)
            for i in range(len(self.ranks))
        ]

    @property
    def peak_rss(self) -> int:
        """Largest peak RSS over ranks and repeats."""
        return max(self.peak_rss_per_rank)

    @property
    def state_bytes(self) -> int:
        """Largest resident parameter + gradient + optimizer bytes over ranks."""
        return max(r.state_bytes for r in self.ranks)

    @property
    def wire_bytes_per_step(self) -> float:
        """Largest per-rank bytes per step of all collectives (0: not counted)."""
        return max(sum(r.wire_bytes.values()) for r in self.ranks)

    @property
    def peak_cuda_per_rank(self) -> list[int]:
        """Each rank's largest peak CUDA allocated bytes over repeats (0 on the CPU)."""
        return [
            max(ranks[i].peak_cuda_bytes for ranks in self.runs) for i in range(len(self.ranks))
        ]


# ---------------------------------------------------------------------- rank side


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _local(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):
        local = t.to_local()
        assert isinstance(local, torch.Tensor)
        return local
    return t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_sharded_form(impl: str, name: str, param: torch.Tensor) -> bool:
    """Whether ``param`` is in ``impl``'s sharded form: a DTensor, or a 1-D flat shard."""
    if impl in FLAT_IMPLS:
        return name.endswith("_flat_param") and param.dim() == 1
    return isinstance(param, DTensor)


def _resident(impl: str, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    tensors: list[torch.Tensor] = []
    param_bytes = grad_bytes = optim_bytes = 0
    all_sharded = True
    for name, p in model.named_parameters():
        all_sharded &= _is_sharded_form(impl, name, p)
        local = _local(p)
        tensors.append(local)
        param_bytes += _nbytes(local)
        if p.grad is not None:
            grad = _local(p.grad)
            tensors.append(grad)
            grad_bytes += _nbytes(grad)
    for state in optim.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = _local(value)
                tensors.append(local)
                optim_bytes += _nbytes(local)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return {
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "optim_bytes": optim_bytes,
        "storage_bytes": sum(storages.values()),
        "all_sharded": all_sharded,
    }


def _wrap(
    impl: str,
    model: GPT,
    mesh: DeviceMesh | None,
    device: torch.device,
    bf16: bool,
    comm_quant: str = "",
) -> nn.Module:
    """``model`` (already on ``device``) wrapped as ``impl``; see [Note: device and precision].

    The ``*_quant`` implementations quantize what ``comm_quant`` says.
    """
    low = torch.bfloat16 if bf16 else None
    reduce = torch.float32 if bf16 else None
    if impl == "single":
        return model
    if impl == "ddp":
        return DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    assert mesh is not None
    if impl not in _FSDP_NAMESPACES:
        raise ValueError(f"unknown implementation {impl!r}; choose from {', '.join(IMPLS)}")
    # PyTorch's and shard's FSDP are set up by the same calls on their own names.
    fsdp = importlib.import_module(_FSDP_NAMESPACES[impl])
    if impl in RELEASE_IMPLS:
        fsdp.set_release_host_memory_after_backward(True)
    if impl not in FLAT_IMPLS:
        policy = fsdp.MixedPrecisionPolicy(param_dtype=low, reduce_dtype=reduce)
        for block in model.iter_blocks():
            fsdp.fully_shard(block, mesh=mesh, mp_policy=policy)
        fsdp.fully_shard(model, mesh=mesh, mp_policy=policy)
        if impl in QUANT_IMPLS:
            apply_comm_quant(model, parse_comm_quant(comm_quant))
        return model
    wrap = importlib.import_module(f"{fsdp.__name__}.wrap")
    wrapped: nn.Module = fsdp.FullyShardedDataParallel(
        model,
        sharding_strategy=fsdp.ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=wrap.ModuleWrapPolicy({Block}),
        mixed_precision=fsdp.MixedPrecision(param_dtype=low, reduce_dtype=reduce) if bf16 else None,
        use_orig_params=False,
        device_id=device,  # on the CPU too: PyTorch's wrapper asks for an accelerator otherwise
    )
    if impl in QUANT_IMPLS:
        apply_comm_quant(wrapped, parse_comm_quant(comm_quant))
    return wrapped


class _Profiler:
    """cProfile or torch.profiler around the timed steps of rank 0, or nothing."""

    def __init__(self, cfg: BenchConfig, impl: str, rank: int) -> None:
        self.kind = cfg.profile if rank == 0 and impl in FSDP_IMPLS else None
        self.out = Path(cfg.profile_dir) / impl
        self._cuda = cfg.device == "cuda"
        self._cprofile: cProfile.Profile | None = None
        self._torch: torch.profiler.profile | None = None

    def start(self) -> None:
        if self.kind == "cprofile":
            self._cprofile = cProfile.Profile()
            self._cprofile.enable()
        elif self.kind == "cprofile-cpu":
            self._cprofile = cProfile.Profile(time.thread_time)
            self._cprofile.enable()
        elif self.kind == "torch":
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self._cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._torch = torch.profiler.profile(activities=activities, record_shapes=True)
            self._torch.start()

    def stop(self, steps: int) -> None:
        if self.kind is None:
            return
        self.out.parent.mkdir(parents=True, exist_ok=True)
        if self._cprofile is not None:
            self._cprofile.disable()
            self._cprofile.dump_stats(f"{self.out}.{self.kind}")
            text = io.StringIO()
            stats = pstats.Stats(self._cprofile, stream=text)
            clock = "main-thread CPU" if self.kind == "cprofile-cpu" else "wall"
            text.write(f"# {steps} steps, {clock} time\n\nself time by origin, ms per step:\n")
            for origin, seconds in _cprofile_origins(stats).items():
                text.write(f"  {origin:<44} {seconds / steps * 1e3:9.1f}\n")
            stats.sort_stats("tottime").print_stats(40)
            stats.sort_stats("cumulative").print_stats(60)
            Path(f"{self.out}.{self.kind}.txt").write_text(text.getvalue())
        if self._torch is not None:
            self._torch.stop()
            self._torch.export_chrome_trace(f"{self.out}.trace.json")
            table = self._torch.key_averages().table(sort_by="self_cpu_time_total", row_limit=60)
            Path(f"{self.out}.torch.txt").write_text(f"# {steps} steps\n{table}\n")


_WIRE_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
# torch.distributed function -> (kind, the argument whose bytes count): shard's convention.
_TORCH_COLLECTIVES = {
    "all_gather_single": ("all_gather", 0),
    "all_gather_into_tensor": ("all_gather", 0),
    "all_gather": ("all_gather", 0),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 1),
    "all_reduce": ("all_reduce", 0),
}


class _TorchCommCounter:
    """Bytes of PyTorch FSDP's collectives, counted around ``torch.distributed``'s functions.

    FSDP2 and FSDP1 call ``dist.all_gather_single`` and friends through the
    module at call time, so replacing the module attributes for the timed
    steps sees every call; bytes follow shard's convention (see [Note: what
    is measured]).
    """

    def __init__(self) -> None:
        self.bytes = dict.fromkeys(_WIRE_KINDS, 0)
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> _TorchCommCounter:
        for name, (kind, index) in _TORCH_COLLECTIVES.items():
            original = getattr(dist, name, None)
            if original is None:  # all_gather_single: torch 2.13 has it, 2.11 not
                continue
            self._saved[name] = original
            setattr(dist, name, self._counting(original, kind, index))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)

    def _counting(self, original: Any, kind: str, index: int) -> Any:
        name = list(inspect.signature(original).parameters)[index]

        def call(*args: Any, **kwargs: Any) -> Any:
            value = args[index] if len(args) > index else kwargs[name]
            tensors = value if isinstance(value, (list, tuple)) else [value]
            self.bytes[kind] += sum(t.numel() * t.element_size() for t in tensors)
            return original(*args, **kwargs)

        return call


class _WireCounter:
    """Per-step bytes of one rank's collectives in the timed steps; see [Note: what is measured]."""

    def __init__(self, impl: str) -> None:
        self.impl = impl
        self._torch: _TorchCommCounter | None = None
        self._shard: Any = None
        self._counts: CommCounts | None = None

    def start(self) -> None:
        if self.impl in TORCH_IMPLS:
            self._torch = _TorchCommCounter().__enter__()
        elif self.impl in FSDP_IMPLS:
            self._shard = count_collectives()
            self._counts = self._shard.__enter__()

    def stop(self, steps: int) -> dict[str, float]:
        if self._torch is not None:
            self._torch.__exit__(None, None, None)
            return {kind: n / steps for kind, n in self._torch.bytes.items()}
        if self._shard is not None and self._counts is not None:
            self._shard.__exit__(None, None, None)
            counts = self._counts
            return {
                kind: counts.bytes(kind) / steps
                for kind in ("all_gather", "reduce_scatter", "all_reduce")
            }
        return {}


# Where self time is spent, from a cProfile key ``(file, line, function)``;
# first match wins. C++ compute called from Python shows as a builtin.
_ORIGINS = (
    ("shard engine (python)", ("/shard_runtime/", "/shard_comms/", "/shard_core/"), ()),
    ("torch FSDP2 (python)", ("/torch/distributed/fsdp/_fully_shard/",), ()),
    ("torch FSDP1 (python)", ("/torch/distributed/fsdp/",), ()),
    ("DTensor (python)", ("/torch/distributed/tensor/",), ()),
    ("optimizer (python)", ("/torch/optim/",), ()),
    ("collective wait", (), ("_distributed_c10d.wait",)),
    ("barrier (before timing)", (), ("_distributed_c10d.barrier",)),
    ("collective issue", (), ("_distributed_c10d.",)),
    ("autograd engine (backward compute)", (), ("run_backward",)),
    ("copies (copy_, split/chunk copies)", (), ("copy_", "_copy", "chunk_cat")),
    ("other torch builtins (compute, alloc)", (), ("torch",)),
)


def _cprofile_origins(stats: pstats.Stats) -> dict[str, float]:
    """Total self time (seconds) per origin in ``_ORIGINS``, plus ``other python``."""
    totals = {name: 0.0 for name, _, _ in _ORIGINS} | {"other python": 0.0}
    entries: dict[tuple[str, int, str], tuple[Any, ...]] = stats.stats  # type: ignore[attr-defined]
    for (filename, _, function), (_, _, self_time, *_rest) in entries.items():
        origin = "other python"
        for name, paths, functions in _ORIGINS:
            if any(p in filename for p in paths) or (
                filename == "~" and any(f in function for f in functions)
            ):
                origin = name
                break
        totals[origin] += self_time
    return totals


def _rank_main(rank: int, impl: str, cfg: BenchConfig, init_file: str, queue: Any) -> None:
    """Train ``impl`` on this rank and put a :class:`RankResult` on ``queue``."""
    world = 1 if impl == "single" else cfg.world_size
    threads = cfg.threads
    torch.set_num_threads(threads)
    cuda = cfg.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # Every implementation but the plain model runs in a process group, one of
    # a single rank included (see [Note: device and precision]).
    distributed = impl != "single"
    mesh: DeviceMesh | None = None
    if distributed:
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            device_id=device if cuda else None,
        )
        mesh = init_device_mesh(device.type, (world,))
    sync = torch.cuda.synchronize if cuda else _no_sync
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")
    try:
        base_rss = _peak_rss()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        torch.manual_seed(cfg.seed)
        model = _wrap(
            impl, GPT(cfg.model).to(device), mesh, device, cfg.precision == "bf16", cfg.comm_quant
        )
        optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1)
        per_rank = cfg.global_batch // world
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        profiler = _Profiler(cfg, impl, rank)
        wire = _WireCounter(impl)
        step_times: list[float] = []
        step_cpu_times: list[float] = []
        phase_times: dict[str, list[float]] = {phase: [] for phase in PHASES}
        losses: list[float] = []
        for step in range(cfg.warmup + cfg.steps):
            tokens = synthetic_tokens(cfg.model, cfg.global_batch, seed=cfg.seed, step=step)[rows]
            tokens = tokens.to(device)
            inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
            if step == cfg.warmup:
                profiler.start()
                wire.start()
            sync()
            if world > 1:
                dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            optim.zero_grad(set_to_none=True)
            with autocast:
                logits = model(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            sync()
            forward_end = time.perf_counter()
            loss.backward()  # type: ignore[no-untyped-call]
            sync()
            backward_end = time.perf_counter()
            optim.step()
            sync()
            end, end_cpu = time.perf_counter(), time.process_time()
            losses.append(loss.item())
            if step >= cfg.warmup:
                step_times.append(end - start)
                step_cpu_times.append(end_cpu - start_cpu)
                phase_times["forward"].append(forward_end - start)
                phase_times["backward"].append(backward_end - forward_end)
                phase_times["optimizer"].append(end - backward_end)
        profiler.stop(cfg.steps)
        wire_bytes = wire.stop(cfg.steps)
        resident = _resident(impl, model, optim)
        queue.put(
            RankResult(
                rank=rank,
                threads=threads,
                step_times=step_times,
                step_cpu_times=step_cpu_times,
                phase_times=phase_times,
                losses=losses,
                peak_rss=_peak_rss(),
                base_rss=base_rss,
                profiled=profiler.kind is not None,
                peak_cuda_bytes=torch.cuda.max_memory_allocated(device) if cuda else 0,
                wire_bytes=wire_bytes,
                **resident,
            )
        )
    finally:
        if distributed:
            dist.destroy_process_group()


def _no_sync() -> None:
    """What ``torch.cuda.synchronize`` is on the CPU: nothing to wait for."""


# ---------------------------------------------------------------------- driver side


def _run_impl(impl: str, cfg: BenchConfig) -> list[RankResult]:
    """One run of ``impl`` in fresh processes; its ranks' results, by rank."""
    world = 1 if impl == "single" else cfg.world_size
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        init_file = os.path.join(tmp, "init")
        results = run_ranks(
            impl, world, _rank_main, lambda rank, queue: (rank, impl, cfg, init_file, queue)
        )
    return sorted(results, key=lambda r: r.rank)


def _schedule(impls: list[str], repeat: int) -> list[str]:
    """``impls`` ``repeat`` times, every other pass reversed (ABBA), so drift hits all alike."""
    order: list[str] = []
    for index in range(repeat):
        order += impls if index % 2 == 0 else impls[::-1]
    return order


def _full_state_bytes(model_cfg: GPTConfig) -> int:
    """Parameters + gradients + AdamW ``exp_avg``/``exp_avg_sq`` + one scalar ``step`` each."""
    with torch.device("meta"):
        model = GPT(model_cfg)
    params = list(model.parameters())
    return sum(4 * _nbytes(p) for p in params) + len(params) * 4


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a - b)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _loss_reference(cfg: BenchConfig, results: dict[str, ImplResult]) -> str:
    """The implementation every other one's losses are compared with.

    ``single`` in fp32; in bf16 PyTorch's FSDP (the same bf16 parameters), see
    [Note: device and precision].
    """
    if cfg.precision == "bf16":
        for name in ("torch_fsdp", "torch_fsdp1", *FSDP_IMPLS):
            if name in results:
                return name
    return "single" if "single" in results else next(iter(results))


def _analyse(cfg: BenchConfig, results: dict[str, ImplResult], loss_rtol: float) -> dict[str, Any]:
    full = _full_state_bytes(cfg.model)
    per_rank_ideal = full / cfg.world_size
    loss_ref_name = _loss_reference(cfg, results)
    loss_ref = results[loss_ref_name]
    losses: dict[str, Any] = {}
    for name, r in results.items():
        per_step = [_rel(a, b) for a, b in zip(r.losses, loss_ref.losses, strict=True)]
        repeats_agree = all(
            [x.losses for x in ranks] == [x.losses for x in r.ranks] for ranks in r.runs
        )
        losses[name] = {
            "final": r.final_loss,
            "final_rel_diff": _rel(r.final_loss, loss_ref.final_loss),
            "max_rel_diff_any_step": max(per_step),
            "repeats_bitwise_equal": repeats_agree,
            # See [Note: device and precision]: in bf16 the plain model's arithmetic differs.
            "judged": name != "single" or loss_ref_name == "single",
        }
    losses_match = all(
        v["max_rel_diff_any_step"] <= (QUANT_LOSS_RTOL if name in QUANT_IMPLS else loss_rtol)
        for name, v in losses.items()
        if v["judged"]
    )
    state: dict[str, Any] = {}
    for name in FSDP_IMPLS:
        if name in results:
            worst = max(_rel(rank.state_bytes, per_rank_ideal) for rank in results[name].ranks)
            state[name] = {"max_rel_diff_vs_full_over_n": worst, "met": worst <= STATE_TOLERANCE}
    ratios: dict[str, dict[str, Any]] = {}
    targets: dict[str, Any] = {}
    for shard_name, reference in PAIRS:
        if reference not in results:
            continue
        ref = results[reference]
        ratios[reference] = {name: _ratios(r, ref) for name, r in results.items()}
        if shard_name in results:
            shard = ratios[reference][shard_name]
            targets[shard_name] = {
                "reference": reference,
                "step_time_ratio_le_1.00": shard["step_time"] <= STEP_TIME_TARGET,
                "step_time_ratio_le_0.90_aim": shard["step_time"] <= STEP_TIME_AIM,
                "peak_rss_le_torch": shard["peak_rss"] <= 1.0,
                "state_within_0.1pct_of_full_over_n": state[shard_name]["met"],
            }
            if shard_name in QUANT_IMPLS:
                targets[shard_name]["wire_bytes_ratio_le_0.30"] = (
                    shard["wire_bytes"] <= WIRE_BYTES_TARGET
                )
    return {
        "full_state_bytes": full,
        "full_state_over_n_bytes": per_rank_ideal,
        "loss_reference": loss_ref_name,
        "loss_rtol": loss_rtol,
        "losses": losses,
        "losses_match": losses_match,
        "state": state,
        "ratios": ratios,
        "targets": targets,
    }


def _ratios(r: ImplResult, ref: ImplResult) -> dict[str, float]:
    """``r``'s figures over ``ref``'s."""
    return {
        "step_time": r.median_step_s / ref.median_step_s,
        "cpu_time": r.median_cpu_s / ref.median_cpu_s,
        "tokens_per_s": r.tokens_per_s / ref.tokens_per_s,
        "peak_rss": r.peak_rss / ref.peak_rss,
        "peak_rss_over_base": (
            max(r.peak_rss_over_base_per_rank) / max(ref.peak_rss_over_base_per_rank)
        ),
        "state_bytes": r.state_bytes / ref.state_bytes,
        "wire_bytes": (
            r.wire_bytes_per_step / ref.wire_bytes_per_step
            if r.wire_bytes_per_step and ref.wire_bytes_per_step
            else float("nan")
        ),
    }


def _report(cfg: BenchConfig, results: dict[str, ImplResult], analysis: dict[str, Any]) -> str:
    repeat = len(next(iter(results.values())).runs)
    cuda = cfg.device == "cuda"
    setting = f" device={cfg.device} precision={cfg.precision}"
    if (cfg.device, cfg.precision) == ("cpu", "fp32"):
        setting = ""  # the table of the default run stays as it was
    lines = [
        f"model: {cfg.model}",
        f"world_size={cfg.world_size} batch/rank={cfg.batch} global tokens/step="
        f"{cfg.global_batch * cfg.model.seq_len} steps={cfg.steps} warmup={cfg.warmup} "
        f"repeat={repeat} threads/rank={cfg.threads}{setting}",
        "",
        f"{'impl':<17} {'step ms':>8} {'per-repeat':>15} {'cpu ms':>7} {'tokens/s':>9} "
        f"{'peakRSS MiB/rank':>17} {'(over base)':>12} {'state MiB/rank':>15} {'final loss':>10}"
        f" {'wire MiB/step':>13}" + (f" {'peakCUDA MiB/rank':>18}" if cuda else ""),
    ]
    for name, r in results.items():
        runs = "/".join(f"{m * 1e3:.0f}" for m in r.run_medians)
        rss = "/".join(_mib(x) for x in r.peak_rss_per_rank)
        over = "/".join(_mib(x) for x in r.peak_rss_over_base_per_rank)
        state = "/".join(_mib(x.state_bytes) for x in r.ranks)
        peak_cuda = "/".join(_mib(x) for x in r.peak_cuda_per_rank)
        flag = " (profiled)" if any(x.profiled for ranks in r.runs for x in ranks) else ""
        wire = _mib(r.wire_bytes_per_step) if r.wire_bytes_per_step else "-"
        lines.append(
            f"{name:<17} {r.median_step_s * 1e3:>8.1f} {runs:>15} {r.median_cpu_s * 1e3:>7.0f} "
            f"{r.tokens_per_s:>9.0f} {rss:>17} {over:>12} {state:>15} {r.final_loss:>10.6f}"
            f" {wire:>13}" + (f" {peak_cuda:>18}" if cuda else "") + flag
        )
    lines.append("")
    lines.append(f"{'phases ms':<17} {'forward':>8} {'backward':>9} {'optimizer':>10}")
    for name, r in results.items():
        fwd, bwd, opt = (r.median_phase_s(phase) * 1e3 for phase in PHASES)
        lines.append(f"{name:<17} {fwd:>8.1f} {bwd:>9.1f} {opt:>10.1f}")
    lines.append(
        f"full state {_mib(analysis['full_state_bytes'])} MiB; "
        f"full/N = {_mib(analysis['full_state_over_n_bytes'])} MiB"
    )
    for reference, ratios in analysis["ratios"].items():
        lines += [
            "",
            f"ratios vs {reference + ':':<18} step time  cpu time  tokens/s  peak RSS  (over base)"
            "  state   wire",
        ]
        for name, q in ratios.items():
            lines.append(
                f"  {name:<17} {q['step_time']:>18.3f} {q['cpu_time']:>9.3f} "
                f"{q['tokens_per_s']:>9.3f} {q['peak_rss']:>9.3f} {q['peak_rss_over_base']:>12.3f} "
                f"{q['state_bytes']:>6.3f} {q['wire_bytes']:>6.3f}"
            )
    for name, s in analysis["state"].items():
        lines.append(
            f"{name}: state per rank vs full/N: max rel diff {s['max_rel_diff_vs_full_over_n']:.2e}"
        )
        if not all(x.all_sharded for x in results[name].ranks):
            form = "flat 1-D shards" if name in FLAT_IMPLS else "DTensors"
            lines.append(f"WARNING {name}: some parameters are not {form} after the last step")
    lines.append("")
    lines.append(
        f"losses vs {analysis['loss_reference']} (rtol {analysis['loss_rtol']:g}; "
        f"{QUANT_LOSS_RTOL:g} for quantized communication):"
    )
    for name, v in analysis["losses"].items():
        lines.append(
            f"  {name:<17} final {v['final']:.6f}  final rel diff {v['final_rel_diff']:.2e}  "
            f"max rel diff over steps {v['max_rel_diff_any_step']:.2e}"
            + ("" if v["repeats_bitwise_equal"] else "  (repeats differ)")
            + ("" if v["judged"] else "  (not judged: autocast on fp32 weights)")
        )
    lines.append(f"losses match: {'yes' if analysis['losses_match'] else 'NO'}")
    for shard_name, targets in analysis["targets"].items():
        lines.append("")
        lines.append(f"{shard_name} targets (vs {targets['reference']}):")
        for name, met in targets.items():
            if name != "reference":
                lines.append(f"  {name:<36} {'met' if met else 'NOT MET'}")
    return "\n".join(lines)


@dataclass(frozen=True)
class _Args:
    cfg: BenchConfig
    impls: list[str]
    repeat: int
    loss_rtol: float
    json_out: str | None
    parse_only: bool = False


def _parse(argv: list[str] | None) -> _Args:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--mlp-ratio", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--steps", type=int, default=12, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs of each implementation, in ABBA order"
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=None, help="threads per rank (default cores // world)"
    )
    parser.add_argument(
        "--impls",
        default=",".join(DEFAULT_IMPLS),
        help=(
            f"comma-separated subset of {','.join(IMPLS)} "
            "(default: all but the *_quant and *_release ones)"
        ),
    )
    parser.add_argument(
        "--comm-quant",
        dest="comm_quant",
        default="weights,grads",
        help="what the *_quant implementations quantize (shard train --comm-quant syntax; "
        "default weights,grads: int8 all-gathers and int8 reductions with error feedback)",
    )
    parser.add_argument(
        "--loss-rtol",
        type=float,
        default=None,
        help="largest relative loss difference from the reference at any step "
        "(default 1e-4; 2e-2 with --precision bf16)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo ranks; cuda: NCCL, rank r on cuda:r (see [Note: device and precision])",
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: autocast compute, and bf16 parameters / fp32 reduction for the FSDP ones",
    )
    parser.add_argument(
        "--parse-only",
        action="store_true",
        help="check the options, print the configuration as JSON and exit (nothing runs)",
    )
    parser.add_argument("--profile", choices=PROFILERS, default=None)
    parser.add_argument("--profile-dir", default="runs/bench_train_profile")
    parser.add_argument("--json", default=None, help="write every measurement to this file")
    args = parser.parse_args(argv)
    impls = [name.strip() for name in args.impls.split(",") if name.strip()]
    unknown = [name for name in impls if name not in IMPLS]
    if unknown or not impls:
        parser.error(f"--impls: unknown {unknown or impls}; choose from {', '.join(IMPLS)}")
    if min(args.steps, args.repeat, args.batch, args.world_size) < 1 or args.warmup < 0:
        parser.error("need --steps, --repeat, --batch, --world-size >= 1 and --warmup >= 0")
    cores = os.cpu_count() or 1
    cfg = BenchConfig(
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
        warmup=args.warmup,
        lr=args.lr,
        seed=args.seed,
        threads=args.threads or max(1, cores // args.world_size),
        profile=args.profile,
        profile_dir=args.profile_dir,
        device=args.device,
        precision=args.precision,
        comm_quant=args.comm_quant,
    )
    loss_rtol = args.loss_rtol
    if loss_rtol is None:
        loss_rtol = BF16_LOSS_RTOL if args.precision == "bf16" else FP32_LOSS_RTOL
    return _Args(cfg, impls, args.repeat, loss_rtol, args.json, args.parse_only)


def _check_device(cfg: BenchConfig) -> str | None:
    """Why ``cfg.device`` cannot run ``cfg.world_size`` ranks here, or ``None`` if it can."""
    if cfg.device != "cuda":
        return None
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"--device cuda: torch {torch.__version__} ({build}) sees no CUDA device here"
    if cfg.world_size > torch.cuda.device_count():
        return (
            f"--device cuda: --world-size {cfg.world_size} needs that many GPUs, "
            f"this machine has {torch.cuda.device_count()}"
        )
    return None


def _record(
    cfg: BenchConfig,
    results: dict[str, ImplResult],
    analysis: dict[str, Any],
    env: dict[str, Any],
) -> dict[str, Any]:
    return {
        "config": asdict(cfg),
        "env": env,
        "results": {
            name: {
                "median_step_s": r.median_step_s,
                "median_step_s_per_repeat": r.run_medians,
                "pooled_median_step_s": r.pooled_median_step_s,
                "median_cpu_s": r.median_cpu_s,
                "median_phase_s": {phase: r.median_phase_s(phase) for phase in PHASES},
                "tokens_per_s": r.tokens_per_s,
                "peak_rss_bytes_per_rank": r.peak_rss_per_rank,
                "peak_rss_over_base_bytes_per_rank": r.peak_rss_over_base_per_rank,
                "state_bytes": r.state_bytes,
                "peak_cuda_bytes_per_rank": r.peak_cuda_per_rank,
                "losses": r.losses,
                "runs": [
                    [asdict(x) | {"state_bytes": x.state_bytes} for x in ranks] for ranks in r.runs
                ],
            }
            for name, r in results.items()
        },
        "analysis": analysis,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 if the losses of the implementations disagree."""
    args = _parse(argv)
    cfg = args.cfg
    if args.parse_only:
        config = asdict(cfg) | {"impls": args.impls, "repeat": args.repeat}
        print(json.dumps(config | {"loss_rtol": args.loss_rtol, "json": args.json_out}))
        return 0
    problem = _check_device(cfg)
    if problem is not None:
        print(f"bench_train: {problem}", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    started = time.perf_counter()
    runs: dict[str, list[list[RankResult]]] = {impl: [] for impl in args.impls}
    for impl in _schedule(args.impls, args.repeat):
        t0 = time.perf_counter()
        runs[impl].append(_run_impl(impl, cfg))
        print(f"[{impl}] done in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    tokens = cfg.global_batch * cfg.model.seq_len
    results = {impl: ImplResult(impl, impl_runs, tokens) for impl, impl_runs in runs.items()}
    analysis = _analyse(cfg, results, args.loss_rtol)
    load_after = os.getloadavg()
    print(_report(cfg, results, analysis))
    print(
        f"\nwall {time.perf_counter() - started:.0f}s; load average before "
        f"{load_before[0]:.2f}, after {load_after[0]:.2f} (1 min) on {os.cpu_count()} cores"
    )
    if args.json_out is not None:
        env = {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cores": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": load_after,
            "argv": sys.argv,
        }
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(_record(cfg, results, analysis, env), indent=2) + "\n")
    return 0 if analysis["losses_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
