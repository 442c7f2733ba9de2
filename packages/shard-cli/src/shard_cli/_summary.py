"""What a ``shard train`` run reports at its end: the record ``summary.json`` holds.

Rank 0 builds it (``_train.py``) and ``_report.py`` formats it for the
terminal; it lives apart from both so that the formatting, tested without
running anything, does not import the training loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunSummary"]


@dataclass
class RunSummary:
    """Everything ``summary.json`` holds; rank 0 builds it at the end of a run.

    Attributes:
        options: The run's options.
        world_size: Number of ranks.
        device: The compute device type.
        backend: The process group's backend.
        parameters: Parameters of the model.
        trainable: Of those, the ones that train (``--lora``/``--freeze``
            freeze the others); ``None`` in summaries written before it was
            recorded.
        steps_run: Steps this launch ran (after a resume: since the checkpoint).
        first_loss: The loss of this launch's first step.
        last_loss: The loss of the last step.
        tokens_per_s: Tokens per second over this launch (all ranks).
        wall_s: Wall time of this launch's training loop.
        measured_step: The first profiled step (see [Note: a step] in ``_train.py``).
        measured_steps: How many consecutive steps were profiled.
        ranks: Per rank: ``params``, ``grads``, ``optim``, ``peak`` (the lowest
            of the profiled steps' peaks), ``peak_max`` (the highest),
            ``baseline`` (bytes) and ``rss_peak`` (the process's peak resident size).
        plan: What ``shard plan`` predicts for rank 0 (``params``, ``grads``,
            ``optim``, ``activations``, ``in_flight``, ``peak``) and, under
            ``ranks``, each rank's ``params``/``grads``/``optim``.
        unsharded: What one unsharded process would hold (plan).
        comm_per_step: Calls and bytes per collective kind per step.
        time: Per profiled step on rank 0, averaged: ``step_s``, ``comm_s``, ``compute_s``.
    """

    options: dict[str, Any]
    world_size: int
    device: str
    backend: str
    parameters: int
    steps_run: int
    first_loss: float
    last_loss: float
    tokens_per_s: float
    wall_s: float
    measured_step: int
    measured_steps: int
    ranks: list[dict[str, int]] = field(default_factory=list)
    plan: dict[str, Any] = field(default_factory=dict)
    unsharded: dict[str, int] = field(default_factory=dict)
    comm_per_step: dict[str, dict[str, int]] = field(default_factory=dict)
    time: dict[str, float] = field(default_factory=dict)
    trainable: int | None = None
