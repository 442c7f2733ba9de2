"""The wrapper's ``training_state`` and ``_assert_state``, in PyTorch FSDP1's three states.

[Note: a thin _assert_state]
PyTorch's shared FSDP1 test helpers (``torch.testing._internal.common_fsdp``)
end a training loop with ``model._assert_state(TrainingState.IDLE)``, and
PyTorch's own ``apply`` and ``clip_grad_norm_`` refuse to run unless the
wrapper is idle. ``FullyShardedDataParallel`` keeps a private
``_assert_state`` so that PyTorch's helpers drive shard's wrapper unchanged:
it is the one private method of PyTorch's wrapper shard copies, because it is
the one those helpers call. It takes PyTorch's ``TrainingState`` members (or
shard's :class:`TrainingState`, or a list of either) and compares them by
name, so shard never imports PyTorch's enum; a state it is not in is a
``ValueError`` worded as PyTorch words it ("expected to be in states ...
but current state is ..."), followed by what to do. The wrapper's state is
read from its unit, not stored: ``FORWARD_BACKWARD`` from the unit's
pre-forward until the end of its backward, ``SUMMON_FULL_PARAMS`` inside
``summon_full_params``, ``IDLE`` otherwise.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from shard_runtime._unit import TrainingState as UnitTrainingState

__all__ = ["TrainingState", "check_state", "wrapper_state"]


class TrainingState(enum.Enum):
    """Where a ``FullyShardedDataParallel`` is, with the names of PyTorch's FSDP1 states."""

    # Between steps, outside summon_full_params.
    IDLE = enum.auto()
    # From the unit's forward until its backward is done.
    FORWARD_BACKWARD = enum.auto()
    # Inside summon_full_params (also during apply()).
    SUMMON_FULL_PARAMS = enum.auto()


def wrapper_state(unit_state: UnitTrainingState, in_summon: bool) -> TrainingState:
    """The wrapper's state from its unit's and whether it is inside ``summon_full_params``."""
    if in_summon:
        return TrainingState.SUMMON_FULL_PARAMS
    if unit_state is UnitTrainingState.IDLE:
        return TrainingState.IDLE
    return TrainingState.FORWARD_BACKWARD


def check_state(current: TrainingState, expected: object, who: str) -> None:
    """Raise ``ValueError`` unless ``current`` is (by name) one of ``expected``.

    ``expected`` is one enum member or an iterable of them, PyTorch's or
    shard's; ``who`` names the wrapper in the message. See [Note: a thin
    _assert_state].
    """
    wanted = list(expected) if isinstance(expected, Iterable) else [expected]
    names = {getattr(state, "name", state) for state in wanted}
    if current.name in names:
        return
    fix = {
        TrainingState.SUMMON_FULL_PARAMS: "leave the summon_full_params block first",
        TrainingState.FORWARD_BACKWARD: "call it between steps, after the backward",
        TrainingState.IDLE: "call it from inside forward/backward or summon_full_params",
    }[current]
    raise ValueError(
        f"expected to be in states {wanted} but current state is {current} ({who}); {fix}"
    )
