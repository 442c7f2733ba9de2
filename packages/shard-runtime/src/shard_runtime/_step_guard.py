"""Refuse an optimizer step on gradients a unit has not reduced yet.

[Note: optimizer step guard]
A sharded parameter's gradient is complete only once its unit's
reduce-scatter has run, which happens during backward, unit by unit, and
for the last units only at the end of backward. An ``optimizer.step()``
called earlier (from a backward hook, a gradient hook, an autograd
function) would silently step on a missing or local-only gradient, and the
ranks would drift apart.

So the first root to finish its lazy init registers one global optimizer
step pre-hook (``register_optimizer_step_pre_hook``, once per process). The
hook costs one call outside backward: it returns unless the autograd engine
is running a backward on this thread and some live root is between its
first pre-backward and its end of backward. Only then does it map the
optimizer's parameters to the units that hold them and raise
:class:`~shard_core.errors.OptimizerStepError`, naming the first unit whose
gradients are not reduced yet. Stepping inside backward on units that are
already reduced (optimizer-in-backward done per unit) is allowed: the hook
first lands the reductions still in flight, so the step sees complete
gradients.

Outside backward the hook does one thing more: a root whose last backward
ran with ``set_is_last_backward(False)`` may still have reductions in flight
(see [Note: a backward that is not the last] in ``_state.py``). PyTorch leaves
such a step to the user's care; shard lands them first, so a step taken
there sees complete gradients instead of missing ones. The hook also counts
the steps (``_optimizer_steps.py``), for the units kept unsharded.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from shard_core.errors import OptimizerStepError
from shard_runtime._optimizer_steps import count_optimizer_step
from shard_runtime._unit import TrainingState

if TYPE_CHECKING:
    from shard_runtime._state import UnitState

__all__ = ["watch_root"]

_ROOTS: weakref.WeakSet[UnitState] = weakref.WeakSet()
_HANDLE: list[RemovableHandle] = []


def watch_root(root: UnitState) -> None:
    """Guard optimizer steps on ``root``'s units; see [Note: optimizer step guard]."""
    _ROOTS.add(root)
    if not _HANDLE:
        _HANDLE.append(register_optimizer_step_pre_hook(_pre_step))


def _pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # A compiled optimizer step traces this hook: it folds to nothing there (a
    # compiled step inside backward is not guarded). Eager, outside backward: one C call
    # and a look at each root's reductions in flight.
    if torch.compiler.is_compiling():
        return
    count_optimizer_step()  # See _optimizer_steps.py.
    if torch._C._current_graph_task_id() == -1:
        for root in list(_ROOTS):
            root.land_reductions()
        return
    for root in list(_ROOTS):
        if root._final_callback_queued:
            _check(optimizer, root)


def _check(optimizer: torch.optim.Optimizer, root: UnitState) -> None:
    owners = {
        id(param): (state, unit)
        for state in root.all_states
        for unit in state.units
        for param in unit.layout.registered_params()
    }
    held = False
    for group in optimizer.param_groups:
        for param in group["params"]:
            owner = owners.get(id(param))
            if owner is None:
                continue
            held = True
            state, unit = owner
            if unit.layout.num_trainable and unit.training_state is not TrainingState.POST_BACKWARD:
                name = unit.label or f"the root {state.class_name}"
                where = (
                    "is running"
                    if unit.training_state is TrainingState.PRE_BACKWARD
                    else "has not started"
                )
                raise OptimizerStepError(
                    f"{type(optimizer).__name__}.step() ran during backward, before the unit "
                    f"{name!r} reduced its gradients (its backward {where}), so it would "
                    "step on gradients that are "
                    "missing or hold only this rank's part; call optimizer.step() after "
                    "loss.backward() returns (or, stepping per unit in backward, only for "
                    "units whose backward has finished)"
                )
    if held:
        # Every unit it holds has reduced, but the last reductions may still be in
        # flight: land them, so the step sees the complete sharded gradients.
        root.land_reductions()
