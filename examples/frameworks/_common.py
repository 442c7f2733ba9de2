"""What every framework example shares: the switch, a tiny model and its data, and the JSON dump.

Each example trains the same tiny model the framework's way, once on PyTorch's
``fully_shard`` and once on shard's; the only difference between the two runs
is :func:`select_fsdp` calling ``use_shard_for_torch_fsdp()``. The framework's
code, and the example's own, read PyTorch's FSDP names through the module
(``torch.distributed.fsdp.fully_shard``) when they use them, so they pick up
whichever implementation is selected.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

IMPLS = ("torch", "shard")
DIM = 16
BATCH = 8


def parse_args(description: str) -> argparse.Namespace:
    """The switch ``--impl torch|shard|both`` (or SHARD_EXAMPLE_IMPL) and the run's paths."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--impl",
        choices=(*IMPLS, "both"),
        default=os.environ.get("SHARD_EXAMPLE_IMPL", "shard"),
        help="whose fully_shard runs: PyTorch's, shard's (through use_shard_for_torch_fsdp), "
        "or both one after the other in this process",
    )
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps")
    parser.add_argument("--out", type=Path, default=None, help="write the per-step losses here")
    parser.add_argument(
        "--workdir", type=Path, default=Path("runs/frameworks"), help="checkpoints go here"
    )
    return parser.parse_args()


def impls(choice: str) -> tuple[str, ...]:
    """The implementations ``--impl`` asks for, PyTorch's first."""
    return IMPLS if choice == "both" else (choice,)


@contextlib.contextmanager
def select_fsdp(impl: str) -> Iterator[None]:
    """PyTorch's FSDP names resolve to shard's inside this block when ``impl`` is "shard"."""
    if impl == "torch":
        yield
        return
    from shard_runtime.integrations import use_shard_for_torch_fsdp

    with use_shard_for_torch_fsdp():
        yield


class Block(nn.Module):
    """One residual MLP block: the unit each example shards on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class TinyModel(nn.Module):
    """Three blocks and a head, small enough that a step takes milliseconds on a CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).squeeze(-1)


def build_model(seed: int = 0) -> TinyModel:
    """The same initial weights on every rank and in every run."""
    torch.manual_seed(seed)
    return TinyModel()


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's micro-batch ``micro`` of step ``step``: a fixed function of the three."""
    generator = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    x = torch.randn(BATCH, DIM, generator=generator)
    return x, x.sum(-1).sin()


class CollectiveCounter(TorchDispatchMode):
    """Counts the process-group collectives dispatched while active, by op name.

    PyTorch's FSDP and shard both reach gloo through ``torch.distributed``,
    whose collectives are ``c10d`` dispatcher ops, so the same counter sees
    both and tells whether a backward reduced gradients.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func.namespace in ("c10d", "_c10d_functional"):
            self.counts[func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def reductions(self) -> int:
        """Reduce-scatters and all-reduces: the collectives that carry gradients."""
        return sum(n for name, n in self.counts.items() if "reduce" in name)


def dump(out: Path | None, results: dict[str, Any], rank: int) -> None:
    """Rank 0 prints the results and writes them to ``out`` as JSON."""
    if rank != 0:
        return
    text = json.dumps(results, indent=1, sort_keys=True)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)


def run_each(choice: str, train: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """``train(impl)`` under :func:`select_fsdp` for each implementation asked for."""
    results = {}
    for impl in impls(choice):
        with select_fsdp(impl):
            results[impl] = train(impl)
    return results
