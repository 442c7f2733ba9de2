"""Optimizer state of flat-sharded parameters: full shapes in state dicts, reshards across worlds.

``ToyNet`` with ``flat_shard_placement``: at 2 ranks the 21-row inner
weights are flat (21 is odd) and the 10-row ones are not; at 3 ranks the
10-row ones are flat too and the 21-row ones are not; at 4 both are. A
checkpoint saved at 2 ranks after two AdamW steps must hold the state of the
unsharded model (checked against one process trained on the same data), and
must load at 3 and at 4 ranks into the same full state and continue the run.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shard_checkpoint import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    load,
    save,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from shard_runtime import flat_shard_placement, fully_shard
from shard_testing import RankPool
from shard_testing.models import ToyNet, sharded_toy_net
from shard_testing.resume import STEPS, Result, assert_resumed, resume_batches, train_step

FULL = StateDictOptions(full_state_dict=True)
LR, DECAY = 0.05, 0.1


def _build(*, zeroed: bool = False) -> tuple[ToyNet, torch.optim.Optimizer]:
    shard = functools.partial(fully_shard, shard_placement_fn=flat_shard_placement)
    model = sharded_toy_net(shard, zeroed=zeroed)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)


def _shapes(osd: dict[str, Any]) -> dict[str, dict[str, tuple[int, ...]]]:
    return {
        fqn: {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
        for fqn, state in osd["state"].items()
    }


MATRIX_NUMELS = {10 * 6, 21 * 10, 10 * 21, 3 * 10}  # embed, inner, outer, head weights


def _local_flat(optim: torch.optim.Optimizer) -> int:
    """How many parameters the optimizer holds as 1-D pieces of a matrix's storage, state alike."""
    count = 0
    for param, state in optim.state.items():
        if param.dim() == 1 and param.shape[0] in MATRIX_NUMELS:
            assert isinstance(state["exp_avg"], DTensor)
            assert state["exp_avg"].shape == param.shape
            count += 1
    return count


def _first_two_steps(path: str) -> dict[str, Any]:
    model, optim = _build()
    for step in range(STEPS - 1):
        train_step(model, optim, step)
    sharded = get_optimizer_state_dict(model, optim)
    save({"model": get_model_state_dict(model), "optim": sharded}, checkpoint_id=path)
    return {
        "sharded_shapes": _shapes(sharded),
        "full": get_optimizer_state_dict(model, optim, options=FULL),
        "flat_in_optimizer": _local_flat(optim),
    }


def _uninterrupted() -> Result:
    model, optim = _build()
    losses = [train_step(model, optim, s) for s in range(STEPS)]
    return losses, get_model_state_dict(model, options=FULL)


def _resume(path: str) -> dict[str, Any]:
    model, optim = _build(zeroed=True)
    state: dict[str, Any] = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim),
    }
    load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    # a copy: the state dict shares the optimizer's own ``step`` tensors, which the next step bumps
    full = copy.deepcopy(get_optimizer_state_dict(model, optim, options=FULL))
    flat = _local_flat(optim)
    losses = [train_step(model, optim, STEPS - 1)]
    return {
        "full": full,
        "flat_in_optimizer": flat,
        "resumed": (losses, get_model_state_dict(model, options=FULL)),
    }


def _one_process_state() -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's state of the unsharded ToyNet after the same two global batches, by name."""
    model = ToyNet(seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    for x, y in resume_batches()[: STEPS - 1]:
        nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        optim.step()
        optim.zero_grad()
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: dict(optim.state[p]) for p in model.parameters()}


def _assert_state_equal(got: dict[str, Any], want: dict[str, dict[str, torch.Tensor]]) -> None:
    assert list(got["state"]) == list(want)
    for fqn, state in want.items():
        assert set(got["state"][fqn]) == set(state), fqn
        for name, value in state.items():
            torch.testing.assert_close(got["state"][fqn][name], value, msg=f"{fqn}.{name}")


@pytest.mark.parametrize("world", [3, 4])
def test_optimizer_state_saved_flat_at_2_ranks_loads_at_another_world_size(
    rank_pool: RankPool, tmp_path: Path, world: int
) -> None:
    """Saved at 2 ranks: full shapes, the unsharded state; at 3 or 4: the same, and it resumes."""
    path = str(tmp_path / "ckpt")
    saved = rank_pool.run(_first_two_steps, 2, path)
    unsharded = _one_process_state()
    shapes = {fqn: {k: tuple(v.shape) for k, v in s.items()} for fqn, s in unsharded.items()}
    for result in saved:
        # the optimizer itself holds flat state (inner: 21 rows, head: 3, over 2 ranks) ...
        assert result["flat_in_optimizer"] == 4
        # ... its state dicts show the unsharded model's shapes, sharded and full
        assert result["sharded_shapes"] == shapes
        _assert_state_equal(result["full"], unsharded)
    reference = rank_pool.run(_uninterrupted, 2)[0]
    for result in rank_pool.run(_resume, world, path):
        assert result["flat_in_optimizer"] == {3: 4, 4: 8}[world]
        _assert_state_equal(result["full"], unsharded)
        assert_resumed(result["resumed"], reference, exact=False)
