"""Measuring a rank: distinct storages, and the allocator trace of a step."""

from __future__ import annotations

import torch
from torch import nn

from shard_cli._measure import profile_step
from shard_comms import buffer_cache_info
from shard_core import held_bytes, state_bytes


def test_held_bytes_counts_each_storage_once() -> None:
    """Views of one storage count once, at the storage's full size; empty ones not at all."""
    base = torch.zeros(100)
    assert held_bytes([base[:10], base[50:], base]) == 400
    assert held_bytes([torch.zeros(0), torch.zeros(3)]) == 12


def test_state_bytes_of_a_plain_model_after_a_step() -> None:
    """Parameters, gradients and AdamW state (two moments and a 4-byte step per parameter)."""
    model = nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()  # type: ignore[no-untyped-call]
    optim.step()
    held = state_bytes(model, optim)
    assert (held.params, held.grads, held.optim) == (60, 60, 2 * 60 + 2 * 4)


def test_profile_step_peak_is_baseline_plus_the_highest_running_sum() -> None:
    """Allocations and frees inside the block give an exact peak; no collective, no comm time."""
    cached = buffer_cache_info().bytes
    with profile_step(torch.device("cpu"), 100) as trace:
        a = torch.empty(1000)
        b = torch.empty(500)
        del a
        c = torch.empty(100)
    assert (b.numel(), c.numel()) == (500, 100)
    assert trace.peak_bytes == 100 + cached + 6000
    assert trace.comm_s == 0.0
    assert trace.comm_events == 0
    assert trace.wall_s > 0
    assert trace.compute_s == trace.wall_s
