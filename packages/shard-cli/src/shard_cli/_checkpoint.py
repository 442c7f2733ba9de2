"""``shard train``'s checkpoints: model, optimizer and step, through shard-checkpoint.

A ``fully_shard`` model is saved with shard-checkpoint's functional API
(``get_model_state_dict`` / ``get_optimizer_state_dict``): DTensor shards
keyed by parameter name, loadable at any world size.

[Note: wrapper checkpoints]
shard-checkpoint does not read the wrapper's flat parameters yet, so for
``--frontend wrapper`` each unit's flat shard (and each AdamW state tensor
of it) is saved as a ``Shard(0)`` DTensor over the shard axis whose global
shape is the padded flat buffer (``(Replicate(), Shard(0))`` with replicas,
a plain tensor without sharding). DCP writes and reads those like any other
DTensor, in place, but the padded shape depends on the world size, so such
a checkpoint resumes at the world size that wrote it (``--resume`` checks).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from shard_checkpoint import (
    get_model_state_dict,
    get_optimizer_state_dict,
    load,
    save,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = ["load_training", "read_step", "save_training"]

_ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def _wrapper_value(local: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    if mesh is None or mesh.size(-1) == 1:
        return local
    placements: tuple[Placement, ...] = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
    shard = mesh.size(-1)
    return DTensor.from_local(
        local,
        mesh,
        placements,
        run_check=False,
        shape=torch.Size([shard * local.numel()]),
        stride=(1,),
    )


def _init_adam_state(optim: torch.optim.Optimizer) -> None:
    """Create AdamW's state as its first step would, so a checkpoint can load into it."""
    for group in optim.param_groups:
        for param in group["params"]:
            if param not in optim.state or not optim.state[param]:
                optim.state[param] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                }


def _state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, frontend: str, mesh: DeviceMesh | None
) -> dict[str, Any]:
    if frontend == "fully_shard":
        return {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optim),
        }
    # See [Note: wrapper checkpoints]
    _init_adam_state(optim)
    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {}
    for name, param in model.named_parameters():
        model_sd[name] = _wrapper_value(param.detach(), mesh)
        state = optim.state[param]
        optim_sd[f"{name}.step"] = state["step"]
        for key in _ADAM_KEYS:
            optim_sd[f"{name}.{key}"] = _wrapper_value(state[key], mesh)
    return {"model": model_sd, "optim": optim_sd}


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
    state = _state_dict(model, optim, frontend, mesh)
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
    state = _state_dict(model, optim, frontend, mesh)
    state["train"] = {"step": 0, "world_size": 0, "frontend": ""}
    load(state, checkpoint_id=path)
    if frontend == "fully_shard":
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
