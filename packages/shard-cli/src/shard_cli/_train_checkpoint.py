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

[Note: step checkpoints of a run]
The checkpoint directory (``--ckpt-dir``, by default ``<run-dir>/checkpoint``)
holds one directory per save, ``step-<N>`` (shard-checkpoint's step layout),
each written atomically and with checksums; ``--resume`` (and a restart)
reads the newest complete one, ``--resume latest-intact`` the newest that
verifies when the newest does not. :class:`TrainCheckpointer` writes them,
blocking or (``--async-checkpoint``) in the background, and removes what a
new one supersedes, only once that one is in place and every rank has read
its files back against their checksums (``save(verify=True)``), on rank 0:

- the first save of a launch that did not resume removes every other step:
  they are an earlier run's, which a new run replaces, as it replaced the
  single checkpoint of the run directories of earlier versions;
- the first save of a resumed launch removes the steps above its own (the
  trajectory it left, e.g. the corrupt checkpoint ``latest-intact`` passed);
- with ``--keep-last K`` every save also removes complete steps older than
  the ``K`` newest, and leftovers of saves that died.

A run directory of an earlier version, whose checkpoint directory is itself
one checkpoint, still resumes: it is read when there is no step directory.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shard_checkpoint import (
    AsyncSave,
    CorruptCheckpointError,
    async_save,
    close_async_saves,
    get_model_state_dict,
    get_optimizer_state_dict,
    latest_checkpoint,
    load,
    prune_checkpoints,
    save,
    set_model_state_dict,
    set_optimizer_state_dict,
    step_checkpoint_id,
)

__all__ = [
    "LAUNCH_ENV",
    "TrainCheckpointInfo",
    "TrainCheckpointer",
    "checkpoint_to_read",
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


def _train_entry(step: int, frontend: str, world_size: int) -> dict[str, Any]:
    return {"step": step, "world_size": world_size, "frontend": frontend, "launch": launch_id()}


def checkpoint_to_read(root: str | os.PathLike[str]) -> Path:
    """The checkpoint ``--resume`` reads in ``root``; see [Note: step checkpoints of a run].

    The newest complete ``step-<N>`` directory; ``root`` itself when it has
    none (a run directory of an earlier version, or nothing yet).
    """
    return latest_checkpoint(root) or Path(root)


class TrainCheckpointer:
    """Writes a run's step checkpoints and removes what they supersede.

    See [Note: step checkpoints of a run]. Collective: every rank calls
    :meth:`save` at the same steps, and :meth:`finish` before it exits.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        asynchronous: bool = False,
        keep_last: int | None = None,
        resumed: bool = False,
    ) -> None:
        self.root = Path(root)
        self.asynchronous = asynchronous
        self.keep_last = keep_last
        self.resumed = resumed
        # - state
        self._saves = 0
        self._in_flight: AsyncSave | None = None

    def save(
        self,
        *,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        frontend: str,
        step: int,
        world_size: int,
    ) -> None:
        """Save ``step`` as ``<root>/step-<step>`` (in the background when asynchronous).

        An asynchronous save first waits for the one in flight, and raises its error.
        """
        state = _state_dict(model, optim)
        state["train"] = _train_entry(step, frontend, world_size)
        path = step_checkpoint_id(self.root, step)
        keep_last = self.keep_last
        if self._saves == 0 and not self.resumed:
            keep_last = 1  # an earlier run's steps: see the Note
        prune = keep_last is not None or self._saves == 0
        self._saves += 1

        def then(saved: Path) -> None:
            if prune and (not dist.is_initialized() or dist.get_rank() == 0):
                prune_checkpoints(self.root, newest=saved, keep_last=keep_last)

        if self.asynchronous:
            self._in_flight = async_save(state, checkpoint_id=path, verify=prune, then=then)
        else:
            save(state, checkpoint_id=path, verify=prune)
            then(path)

    def finish(self) -> None:
        """Wait for the save in flight, if any, and raise its error; free the background
        saves' CPU copy (collective: every rank, after the last save)."""
        in_flight, self._in_flight = self._in_flight, None
        try:
            if in_flight is not None:
                in_flight.result()
        finally:
            if self.asynchronous:
                close_async_saves()


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
    """Save model, optimizer and ``step`` as one checkpoint at ``path``, atomically (collective).

    A single checkpoint, not a step directory: :class:`TrainCheckpointer` writes those.
    """
    state = _state_dict(model, optim)
    state["train"] = _train_entry(step, frontend, world_size)
    save(state, checkpoint_id=path)


def load_training(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    frontend: str,
    mesh: DeviceMesh | None,
    fallback: bool = False,
) -> int:
    """Load the checkpoint to resume from into ``model`` and ``optim``; its step (collective).

    ``path`` is the run's checkpoint directory (see :func:`checkpoint_to_read`)
    or one checkpoint.

    Args:
        fallback: when the newest checkpoint is corrupt, load the newest intact
            one beside it instead (``--resume latest-intact``); rank 0 says so.

    Raises:
        shard_checkpoint.CorruptCheckpointError: the checkpoint is corrupt
            (and ``fallback`` is off, or no intact one is beside it); the
            message names the file, rank, key and the intact checkpoint.
        shard_checkpoint.CheckpointError: no complete checkpoint at ``path``,
            or one of another model (the message names the first key).
    """
    checkpoint = checkpoint_to_read(path)
    try:
        return _load_into(checkpoint, model, optim)
    except CorruptCheckpointError as exc:
        if not fallback or exc.intact is None:
            raise exc.with_fix("resume from it with --resume latest-intact") from None
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(
                f"shard train: --resume latest-intact: {exc.checkpoint} is corrupt ({exc.file} "
                f"{exc.problem}{exc.location()}); resuming from {exc.intact}",
                file=sys.stderr,
                flush=True,
            )
        return _load_into(Path(exc.intact), model, optim)


def _load_into(checkpoint: Path, model: nn.Module, optim: torch.optim.Optimizer) -> int:
    state = _state_dict(model, optim)
    state["train"] = {"step": 0, "world_size": 0, "frontend": ""}
    load(state, checkpoint_id=checkpoint)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    step = state["train"]["step"]
    assert isinstance(step, int)
    return step


def read_info(path: str | os.PathLike[str]) -> TrainCheckpointInfo | None:
    """The step and launch of the checkpoint ``--resume`` reads at ``path`` (one process).

    ``path`` is a run's checkpoint directory (:func:`checkpoint_to_read`) or
    one checkpoint. ``None`` if there is no complete, readable checkpoint
    there: an interrupted save leaves none (shard-checkpoint renames a
    finished directory into place), and one whose ``train`` entry fails its
    checksum is not readable.
    """
    state: dict[str, Any] = {"train": {"step": -1, "launch": ""}}
    try:
        load(state, checkpoint_id=checkpoint_to_read(path), strict=False)
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
