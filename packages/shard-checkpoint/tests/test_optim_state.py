"""Resuming from a checkpoint continues training exactly where it stopped.

Every step uses one global batch of 12 rows, cut into equal slices for 2 or
3 ranks, so runs at different world sizes train on the same data. A run
stops after two AdamW steps and saves model and optimizer; a fresh model
and a fresh optimizer load them and take the third step. At the same
world size the third step's loss and the parameters after it are
bit-identical to an uninterrupted run's; at another world size they match
the uninterrupted run within fp32 round-off (the reductions are ordered
differently).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shard_checkpoint import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    load,
    save,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from shard_runtime import fully_shard
from shard_testing import RankPool
from shard_testing.models import ToyNet, sharded_toy_net
from shard_testing.resume import (
    STEPS,
    Result,
    assert_resumed,
    train_step,
)

FULL_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _build(*, zeroed: bool = False) -> tuple[ToyNet, torch.optim.Optimizer]:
    model = sharded_toy_net(fully_shard, zeroed=zeroed)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _finish(model: ToyNet, losses: list[float]) -> Result:
    return losses, get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _uninterrupted() -> Result:
    model, optim = _build()
    return _finish(model, [train_step(model, optim, s) for s in range(STEPS)])


def _first_two_steps(path: str, flat: bool) -> None:
    model, optim = _build()
    for step in range(STEPS - 1):
        train_step(model, optim, step)
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    save(
        {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optim, options=options),
        },
        checkpoint_id=path,
    )


def _resume(path: str, flat: bool) -> Result:
    model, optim = _build(zeroed=True)
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    state: dict[str, Any] = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim, options=options),
    }
    load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"], options=options)
    return _finish(model, [train_step(model, optim, STEPS - 1)])


def _first_two_steps_full() -> tuple[dict[str, Any], dict[str, Any]]:
    model, optim = _build()
    for step in range(STEPS - 1):
        train_step(model, optim, step)
    return (
        get_model_state_dict(model, options=FULL_ON_RANK0),
        get_optimizer_state_dict(model, optim, options=FULL_ON_RANK0),
    )


def _resume_from_rank0(model_state: dict[str, Any], optim_state: dict[str, Any]) -> Result:
    if dist.get_rank() != 0:
        model_state, optim_state = {}, {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    model, optim = _build(zeroed=True)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optim, optim_state, options=options)
    return _finish(model, [train_step(model, optim, STEPS - 1)])


@pytest.mark.parametrize("flat", [False, True], ids=["nested", "flat"])
def test_resume_at_the_same_world_size_is_bit_identical(
    rank_pool: RankPool, tmp_path: Path, flat: bool
) -> None:
    """Saved after 2 steps on 2 ranks and resumed on 2, step 3 equals the uninterrupted step 3."""
    path = str(tmp_path / "ckpt")
    rank_pool.run(_first_two_steps, 2, path, flat)
    reference = rank_pool.run(_uninterrupted, 2)[0]
    for resumed in rank_pool.run(_resume, 2, path, flat):
        assert_resumed(resumed, reference, exact=True)


def test_resume_at_another_world_size_continues_the_run(
    rank_pool: RankPool, tmp_path: Path
) -> None:
    """Saved on 2 ranks and resumed on 3, step 3 matches the uninterrupted 2-rank run."""
    path = str(tmp_path / "ckpt")
    rank_pool.run(_first_two_steps, 2, path, False)
    reference = rank_pool.run(_uninterrupted, 2)[0]
    for resumed in rank_pool.run(_resume, 3, path, False):
        assert_resumed(resumed, reference, exact=False)


def test_resume_from_full_state_dicts_broadcast_from_rank0(rank_pool: RankPool) -> None:
    """Full model and optimizer state on rank 0 alone, broadcast to 3 ranks, resume the run."""
    results = rank_pool.run(_first_two_steps_full, 2)
    assert results[1] == ({}, {})
    model_state, optim_state = results[0]
    assert set(optim_state) == {"state", "param_groups"}
    reference = rank_pool.run(_uninterrupted, 2)[0]
    for resumed in rank_pool.run(_resume_from_rank0, 3, model_state, optim_state):
        assert_resumed(resumed, reference, exact=False)
