"""``shard train``'s checkpoints: model, optimizer and step, through shard-checkpoint.

Both front ends are saved with shard-checkpoint's functional API
(``get_model_state_dict`` / ``get_optimizer_state_dict``): ``Shard(0)``
DTensors keyed by the unwrapped model's parameter names, whatever the front
end, strategy or world size. A checkpoint written with ``--frontend
wrapper`` therefore resumes under ``fully_shard`` and the reverse, and with
another strategy (``--resume`` allows changing them).

With ``--lora``/``--freeze`` the model part holds every parameter, frozen
ones included, and the optimizer part the trainable ones only (the optimizer
is given nothing else); see [Note: what a checkpoint holds when fine-tuning]
in ``_finetune.py``.

Each checkpoint also records the launch that wrote it (``train.launch``, see
:func:`launch_id`): after a restart, a rank resumes only from a checkpoint
of its own launch, never from one an earlier run left in the same directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
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

__all__ = [
    "LAUNCH_ENV",
    "TrainCheckpointInfo",
    "launch_id",
    "load_training",
    "read_info",
    "read_step",
    "save_training",
]

# Set by ``shard train``'s launcher for its ranks: one value per launch, kept across restarts.
LAUNCH_ENV = "SHARD_TRAIN_LAUNCH_ID"


def launch_id() -> str:
    """What identifies this launch of the job, the same on every rank and after restarts.

    ``shard train``'s launcher sets ``SHARD_TRAIN_LAUNCH_ID``; under a bare
    ``torchrun`` the rendezvous id stands in (unique per job with
    ``--standalone`` or a ``--rdzv-id`` of the user's; torchrun's default
    ``none`` is the same for every job, so it identifies nothing, and "" is
    returned). "" when neither is set.
    """
    given = os.environ.get(LAUNCH_ENV) or os.environ.get("TORCHELASTIC_RUN_ID", "")
    return "" if given == "none" else given


@dataclass(frozen=True)
class TrainCheckpointInfo:
    """What a checkpoint says about itself, read without a process group.

    Attributes:
        step: The last step it holds.
        launch: The :func:`launch_id` of the launch that wrote it ("" for a
            checkpoint written before launches were recorded, or by a job with
            no id).
    """

    step: int
    launch: str


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
    state["train"] = {
        "step": step,
        "world_size": world_size,
        "frontend": frontend,
        "launch": launch_id(),
    }
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


def read_info(path: str | os.PathLike[str]) -> TrainCheckpointInfo | None:
    """The step and launch of the checkpoint at ``path`` (one process, no group).

    ``None`` if there is no complete, readable checkpoint there: an
    interrupted save leaves none (shard-checkpoint renames a finished
    directory into place), so what this finds is always loadable.
    """
    state: dict[str, Any] = {"train": {"step": -1, "launch": ""}}
    try:
        load(state, checkpoint_id=path, strict=False)
    except Exception:
        return None
    step, launch = state["train"]["step"], state["train"]["launch"]
    if not isinstance(step, int) or step < 0:
        return None
    return TrainCheckpointInfo(step=step, launch=launch if isinstance(launch, str) else "")


def read_step(path: str | os.PathLike[str]) -> int | None:
    """The step of the checkpoint at ``path`` (one process, no group); ``None`` if unreadable."""
    info = read_info(path)
    return None if info is None else info.step
