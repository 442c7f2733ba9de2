"""A wrapper unit's gathered buffer dies before the next unit's gather.

Full and sharded state dicts of ``FullyShardedDataParallel`` units gather one
unit at a time, so a rank holds one unit's full parameters (or one optimizer
state's) at once, whatever the model's size. A loop variable holding a view
of the previous unit's buffer kept it alive through the next gather: two units
at once, 4 MiB more on each rank in ``test_memory.py``'s model. These tests
watch each buffer ``gather_full`` returns with a weak reference and count the
gathers that started while an earlier buffer was still alive: none, on every
rank, for the model and the optimizer, for the rank that keeps the values and
the one that gets ``{}``.

gloo's worker thread drops its own reference to a collective's output a moment
after ``wait()`` returns, so a buffer counts as alive only if it still is after
``_GRACE_S``; a buffer the caller keeps stays alive through the whole gather.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import shard_checkpoint._flat as flat_module
from shard_checkpoint import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from shard_runtime import FullyShardedDataParallel as FSDP
from shard_runtime import ModuleWrapPolicy
from shard_testing import RankPool
from shard_testing.models import LinearStack

_GRACE_S = 2.0


class _Watch:
    """Wraps ``gather_full``: counts gathers begun while an earlier buffer lived."""

    def __init__(self, gather: Callable[..., list[torch.Tensor]]) -> None:
        self._gather = gather
        self._alive: list[weakref.ref[torch.Tensor]] = []
        self.gathers = 0
        self.overlapping = 0

    def __call__(self, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        deadline = time.monotonic() + _GRACE_S
        while any(ref() is not None for ref in self._alive) and time.monotonic() < deadline:
            time.sleep(0.001)
        if any(ref() is not None for ref in self._alive):
            self.overlapping += 1
        fulls = self._gather(*args, **kwargs)
        self.gathers += 1
        base = fulls[0]._base if fulls[0]._base is not None else fulls[0]
        self._alive = [weakref.ref(base)]
        return fulls


def _count(kind: str, full: bool, cpu_offload: bool) -> tuple[int, int, int]:
    """(gathers, those begun while an earlier buffer lived, entries) on this rank."""
    model = FSDP(LinearStack(layers=4, width=32), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 32)).sum().backward()
    optim.step()
    options = StateDictOptions(full_state_dict=full, cpu_offload=cpu_offload)
    watch = _Watch(flat_module.gather_full)
    flat_module.gather_full = watch  # type: ignore[assignment]
    try:
        if kind == "model":
            entries = len(get_model_state_dict(model, options=options))
        else:
            entries = len(get_optimizer_state_dict(model, optim, options=options).get("state", {}))
    finally:
        flat_module.gather_full = watch._gather  # type: ignore[assignment]
    return watch.gathers, watch.overlapping, entries


@pytest.mark.parametrize("kind", ["model", "optimizer"])
@pytest.mark.parametrize(
    ("full", "cpu_offload"), [(True, True), (True, False), (False, False)], ids=str
)
def test_each_gathered_buffer_dies_before_the_next_gather(
    rank_pool: RankPool, kind: str, full: bool, cpu_offload: bool
) -> None:
    """Four units: four gathers of parameters, eight of Adam's two states, none overlapping."""
    results = rank_pool.run(_count, 2, kind, full, cpu_offload)
    gathers = 4 if kind == "model" else 8
    rank1_entries = 0 if cpu_offload else 4
    assert results == [(gathers, 0, 4), (gathers, 0, rank1_entries)]
