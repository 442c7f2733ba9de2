"""The quick start's main job until ``shard train`` lands: sharded training you can watch.

Trains a small character-level GPT on text built from this repository's own
sources, with every block and the root sharded by ``shard_runtime.fully_shard``
across local CPU ranks (gloo), launched through PyTorch's elastic launcher::

    python tools/train_demo.py                 # 2 ranks, defaults finish in about a minute
    python tools/train_demo.py --nproc 3 --steps 80

Rank 0 prints the loss as it falls, what each rank holds against one
unsharded process, the collectives of one step, and a sample of generated
text. The same worker runs unchanged under ``torchrun`` on several machines
(``torchrun --nnodes 2 --nproc-per-node 4 ... tools/train_demo.py --worker``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))

from gpt import GPT, GPTConfig

from shard_comms import count_collectives, init_distributed
from shard_runtime import fully_shard

ROOT = Path(__file__).resolve().parents[1]


def corpus() -> str:
    """Text the model learns: the project's own documentation and Python sources."""
    files = sorted(ROOT.glob("**/*.md")) + sorted(ROOT.glob("packages/*/src/**/*.py"))
    text = "\n".join(p.read_text(encoding="utf-8", errors="ignore") for p in files)
    return "".join(ch for ch in text if ch.isascii())


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="local ranks to launch")
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=96)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--worker", action="store_true", help="run as one rank (set by the launcher)"
    )
    return parser.parse_args(argv)


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Start ``--nproc`` local ranks of this script through torch.distributed.run."""
    from torch.distributed.run import main as torchrun

    print(
        f"shard demo: training on {args.nproc} local CPU ranks (gloo); "
        "`shard train` replaces this script when shard-cli lands",
        flush=True,
    )
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    torchrun(["--standalone", f"--nproc-per-node={args.nproc}", __file__, "--worker", *argv])
    return 0


def worker(args: argparse.Namespace) -> None:
    state = init_distributed()
    rank, world = state.rank, state.world_size
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    text = corpus()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    config = GPTConfig(
        vocab_size=len(chars),
        d_model=args.d_model,
        n_heads=4,
        n_layers=args.layers,
        seq_len=args.seq,
    )
    torch.manual_seed(0)
    model = GPT(config)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for block in model.iter_blocks():
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(1234 + rank)
    started = time.perf_counter()
    counts = None
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=generator)
        x = torch.stack([data[s : s + args.seq] for s in starts])
        y = torch.stack([data[s + 1 : s + args.seq + 1] for s in starts])
        with count_collectives() as step_counts:
            loss = nn.functional.cross_entropy(model(x).reshape(-1, len(chars)), y.reshape(-1))
            loss.backward()
        optim.step()
        optim.zero_grad()
        counts = step_counts
        value = loss.detach()
        dist.all_reduce(value)
        if rank == 0 and (step == 1 or step % 25 == 0 or step == args.steps):
            elapsed = time.perf_counter() - started
            tokens = step * args.batch * args.seq * world
            print(
                f"step {step:4d}/{args.steps}  loss {float(value) / world:.3f}  "
                f"{tokens / elapsed:8.0f} tok/s",
                flush=True,
            )
    local_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    optim_bytes = sum(
        t.to_local().numel() * t.element_size()
        for s in optim.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    held = torch.tensor([local_bytes, optim_bytes], dtype=torch.float64)
    gathered = [torch.zeros_like(held) for _ in range(world)]
    dist.all_gather(gathered, held)
    sample = generate(model, data[:8], 200, args.seq)
    if rank == 0:
        print(f"\nparameters: {full_bytes / 1e6:.2f} MB in one process; per rank:")
        for r, row in enumerate(gathered):
            print(f"  rank {r}: params {row[0] / 1e6:.3f} MB, AdamW state {row[1] / 1e6:.3f} MB")
        if counts is not None:
            for kind in ("all_gather", "reduce_scatter", "all_reduce"):
                calls, megabytes = counts.calls(kind), counts.bytes(kind) / 1e6
                print(f"  {kind:14s} {calls:3d} calls/step  {megabytes:7.3f} MB/step")
        print("\nsample:", repr("".join(chars[i] for i in sample.tolist())))
    dist.barrier()
    dist.destroy_process_group()


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, length: int, context: int) -> torch.Tensor:
    """Sampled continuation of ``prompt``, the same on every rank (each forward is collective)."""
    generator = torch.Generator().manual_seed(0)
    tokens = prompt.clone()
    for _ in range(length):
        logits = model(tokens[-context:].unsqueeze(0))[0, -1]
        probs = torch.softmax(logits / 0.8, dim=-1)
        tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=generator)])
    return tokens


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.worker:
        worker(args)
        # gloo may abort in interpreter teardown; see shard-testing's notes.
        sys.stdout.flush()
        os._exit(0)
    worker_argv = [
        f"--steps={args.steps}",
        f"--batch={args.batch}",
        f"--seq={args.seq}",
        f"--layers={args.layers}",
        f"--d-model={args.d_model}",
        f"--lr={args.lr}",
    ]
    return launch(args, worker_argv)


if __name__ == "__main__":
    raise SystemExit(main())
