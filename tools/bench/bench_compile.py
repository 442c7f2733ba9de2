"""``torch.compile`` benchmark: shard's ``fully_shard`` and PyTorch's, eager and compiled.

Why: a model sharded with ``fully_shard`` should compile as well under shard
as under PyTorch (see ``[Note: torch.compile]`` in ``shard_runtime/_compile.py``):
the same number of graphs and graph breaks, the same losses, a comparable
compile time and compiled step time. This script trains the same model
(every block sharded, then the root; AdamW) in these cases (``--cases``):

- ``torch_eager`` / ``torch_compiled``: PyTorch ``fully_shard``, without and
  with ``torch.compile(model)`` (default settings);
- ``shard_eager`` / ``shard_compiled``: shard ``fully_shard``, the same;
- ``shard_eager_raw``: shard eager with ``torch.compiler.disable`` replaced by
  the identity while the model is sharded, i.e. the hooks without the wrappers
  that keep them out of ``torch.compile``: what those wrappers cost eagerly.

Each case runs in freshly spawned gloo processes with an Inductor cache
directory of its own (``--warm-cache`` shares one), so every compile time is a
cold compile and no case reuses another's artifacts.

Run from the repository root::

    .venv/bin/python tools/bench/bench_compile.py --world-size 2 --model gpt --steps 12

[Note: what is measured]
- graphs: ``torch._dynamo.utils.counters["stats"]["unique_graphs"]``;
  breaks: the sum of ``counters["graph_break"]``; eager frames: frames Dynamo
  started on and gave up (``counters["frames"]`` total - ok), e.g. a root
  forward that falls back to eager because a hook is disabled inside it.
  Counted on rank 0 over the whole run (forward and backward).
- first step: wall time of step 0 (forward, backward, optimizer step),
  slowest rank; compile is ``first step - median step`` for compiled cases
  (wall, and ``cpu s``: the same in rank 0's process time, steadier on a
  loaded machine; Inductor compiles C++ in worker processes, not counted).
- step: median wall time of the steps after ``--warmup`` (slowest rank,
  after a barrier); cpu: median ``time.process_time`` of those steps.
- losses: every step's loss on rank 0; all cases must agree.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from shard_cli.gpt import GPT, GPTConfig, synthetic_tokens

CASES = ("torch_eager", "torch_compiled", "shard_eager", "shard_compiled", "shard_eager_raw")


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class _MLP(nn.Module):
    """The compat test's model: linear blocks and a linear head summed to a scalar."""

    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum()


def _build(args: argparse.Namespace) -> tuple[nn.Module, Any]:
    """The model and a function ``(model, step, rank) -> loss``."""
    torch.manual_seed(0)
    if args.model == "mlp":
        model: nn.Module = _MLP(args.d_model, args.layers)

        def mlp_loss(m: nn.Module, step: int, rank: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(1000 * step + rank)
            out: torch.Tensor = m(torch.randn(args.batch, args.d_model, generator=g))
            return out

        return model, mlp_loss
    config = GPTConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_heads=args.heads,
        n_layers=args.layers,
        seq_len=args.seq,
    )
    model = GPT(config)

    def gpt_loss(m: nn.Module, step: int, rank: int) -> torch.Tensor:
        tokens = synthetic_tokens(config, args.batch, seed=rank, step=step)
        logits = m(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    return model, gpt_loss


def _rank_main(rank: int, world: int, port: int, case: str, args: argparse.Namespace) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = _run_case(rank, case, args)
        Path(args.out_dir, f"{case}.{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _run_case(rank: int, case: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    impl, mode = case.split("_", 1)
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from shard_runtime import fully_shard  # type: ignore[assignment]
    model, loss_fn = _build(args)
    blocks = model.blocks if isinstance(model.blocks, nn.ModuleList) else []
    disable = torch.compiler.disable
    if mode == "eager_raw":
        torch.compiler.disable = lambda fn=None, recursive=True, *, reason=None: fn
    try:
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
    finally:
        torch.compiler.disable = disable
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch._dynamo.reset()
    counters.clear()
    step_fn = torch.compile(model) if mode == "compiled" else model
    walls: list[float] = []
    cpus: list[float] = []
    losses: list[float] = []
    for step in range(args.steps):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        loss = loss_fn(step_fn, step, rank)
        loss.backward()
        optim.step()
        optim.zero_grad()
        value = loss.item()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        slowest = torch.tensor([wall])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        walls.append(slowest.item())
        cpus.append(cpu)
        losses.append(value)
    return {
        "losses": losses,
        "walls": walls,
        "cpus": cpus,
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "break_reasons": sorted(reason.split("\n")[0] for reason in counters["graph_break"]),
        "eager_frames": counters["frames"]["total"] - counters["frames"]["ok"],
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _run(case: str, args: argparse.Namespace, cache_root: str) -> dict[str, Any]:
    cache = cache_root if args.warm_cache else tempfile.mkdtemp(prefix=f"{case}.", dir=cache_root)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    mp.spawn(_rank_main, args=(args.world_size, _free_port(), case, args), nprocs=args.world_size)
    result: dict[str, Any] = json.loads(Path(args.out_dir, f"{case}.0.json").read_text())
    return result


def _summary(case: str, result: dict[str, Any], warmup: int) -> dict[str, Any]:
    steady = result["walls"][warmup:]
    step = statistics.median(steady)
    return {
        "case": case,
        "graphs": result["graphs"],
        "breaks": result["breaks"],
        "eager_frames": result["eager_frames"],
        "first_step_s": result["walls"][0],
        "compile_s": result["walls"][0] - step if case.endswith("compiled") else 0.0,
        "compile_cpu_s": (
            result["cpus"][0] - statistics.median(result["cpus"][warmup:])
            if case.endswith("compiled")
            else 0.0
        ),
        "step_ms": 1e3 * step,
        "cpu_ms": 1e3 * statistics.median(result["cpus"][warmup:]),
        "final_loss": result["losses"][-1],
        "losses": result["losses"],
    }


def _loss_report(results: dict[str, dict[str, Any]]) -> list[str]:
    """Compiled cases must match each other exactly, eager cases too; compiled vs eager
    may differ in the last bits (Inductor fuses and reorders float math)."""
    lines = []
    for mode in ("eager", "compiled"):
        group = {c: r["losses"] for c, r in results.items() if c.split("_", 1)[1].startswith(mode)}
        if len(group) > 1:
            reference = next(iter(group.values()))
            same = all(losses == reference for losses in group.values())
            lines.append(f"losses, {mode}: " + ("identical" if same else f"DIFFER {group}"))
    eager = next((r["losses"] for c, r in results.items() if c.endswith("_eager")), None)
    for case, r in results.items():
        if eager is not None and case.endswith("compiled"):
            diff = max(abs(a - b) for a, b in zip(r["losses"], eager, strict=True))
            lines.append(f"losses, {case} vs eager: max abs difference {diff:.3g}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--warm-cache", action="store_true", help="share one Inductor cache")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    with tempfile.TemporaryDirectory(prefix="bench_compile.") as tmp:
        args.out_dir = tmp
        results = {case: _run(case, args, tmp) for case in args.cases}
    rows = [_summary(case, r, args.warmup) for case, r in results.items()]
    header = (
        f"{'case':<16} {'graphs':>6} {'breaks':>6} {'eager fr':>8} {'compile s':>9} {'cpu s':>6} "
        f"{'step ms':>8} {'cpu ms':>7} {'final loss':>11}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['case']:<16} {row['graphs']:>6} {row['breaks']:>6} {row['eager_frames']:>8} "
            f"{row['compile_s']:>9.2f} {row['compile_cpu_s']:>6.2f} {row['step_ms']:>8.2f} "
            f"{row['cpu_ms']:>7.2f} {row['final_loss']:>11.6f}"
        )
    for line in _loss_report(results):
        print(line)
    for case, r in results.items():
        if r["break_reasons"]:
            print(f"{case} graph breaks: {r['break_reasons']}")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
