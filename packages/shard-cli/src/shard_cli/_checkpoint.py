"""``shard train``'s checkpoints: model, optimizer and step, through shard-checkpoint.

Both front ends are saved with shard-checkpoint's functional API
(``get_model_state_dict`` / ``get_optimizer_state_dict``): ``Shard(0)``
DTensors keyed by the unwrapped model's parameter names, whatever the front
end, strategy or world size. A checkpoint written with ``--frontend
wrapper`` therefore resumes under ``fully_shard`` and the reverse, and with
another strategy (``--resume`` allows changing them).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shard_checkpoint import (
    get_model_state_dict,
    get_optimizer_state_dict,
    load,
    save,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = ["load_training", "read_step", "save_training"]


def _state_dict(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim),
    }


def save_training(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    frontend: str,
    mesh: DeviceMesh | None,
    step: int,
    world_size: int,
) -> None:
    """Save model, optimizer and ``step`` at ``path``, atomically (collective)."""
    state = _state_dict(model, optim)
    state["train"] = {"step": step, "world_size": world_size, "frontend": frontend}
    save(state, checkpoint_id=path)


def load_training(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    frontend: str,
    mesh: DeviceMesh | None,
) -> int:
    """Load the checkpoint at ``path`` into ``model`` and ``optim``; return its step (collective).

    Raises:
        shard_checkpoint.CheckpointError: no complete checkpoint at ``path``,
            or one of another model (the message names the first key).
    """
    state = _state_dict(model, optim)
    state["train"] = {"step": 0, "world_size": 0, "frontend": ""}
    load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    step = state["train"]["step"]
    assert isinstance(step, int)
    return step


def read_step(path: str | os.PathLike[str]) -> int | None:
    """The step of the checkpoint at ``path`` (one process, no group); ``None`` if unreadable."""
    state: dict[str, Any] = {"train": {"step": -1}}
    try:
        load(state, checkpoint_id=path, strict=False)
    except Exception:
        return None
    step = state["train"]["step"]
    return step if isinstance(step, int) and step >= 0 else None
