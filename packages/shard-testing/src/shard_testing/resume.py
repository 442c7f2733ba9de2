"""Helpers for tests that stop a run, resume it from saved state, and compare.

Every step uses one global batch of :data:`ROWS` rows for ``ToyNet`` cut into
equal slices per rank (``ROWS`` divides by 1, 2, 3 and 4), so runs at
different world sizes train on the same data and a resumed step can be
compared with an uninterrupted run's.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shard_testing.models import DIM_IN, DIM_OUT

__all__ = [
    "ROWS",
    "STEPS",
    "Result",
    "assert_bitwise_equal",
    "assert_resumed",
    "resume_batches",
    "train_step",
]

ROWS = 12
STEPS = 3
Result = tuple[list[float], dict[str, torch.Tensor]]
"""A run's losses and its full state dict after them."""


def resume_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The :data:`STEPS` global batches ``(x, y)``, the same in every process."""
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(ROWS, DIM_IN, generator=g), torch.randn(ROWS, DIM_OUT, generator=g))
        for _ in range(STEPS)
    ]


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> float:
    """One step on this rank's slice of batch ``step``; the loss averaged over ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = (t.chunk(world)[rank] for t in resume_batches()[step])
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    optim.step()
    optim.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


def assert_resumed(resumed: Result, reference: Result, *, exact: bool) -> None:
    """The resumed step's loss and state equal the reference's last (bitwise if ``exact``)."""
    losses, params = resumed
    ref_losses, ref_params = reference
    assert list(params) == list(ref_params)
    if exact:
        assert losses == ref_losses[-1:]
        for key, value in ref_params.items():
            assert torch.equal(params[key], value), key
    else:
        torch.testing.assert_close(losses, ref_losses[-1:])
        for key, value in ref_params.items():
            torch.testing.assert_close(params[key], value, msg=functools.partial(_named, key))


def assert_bitwise_equal(got: Any, want: Any, where: str = "") -> None:
    """``got`` holds what ``want`` holds, tensors bit for bit, through nested dicts and lists.

    Dict keys compare as sets; the failing assertion names the path to the
    first difference (``.model.embed.weight``, ``[2]``).
    """
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), where
        for key in want:
            assert_bitwise_equal(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for index, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_bitwise_equal(a, b, f"{where}[{index}]")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), where
    else:
        assert got == want, where


def _named(key: str, message: str) -> str:
    return f"{key}: {message}"
