"""What PyTorch's own FSDP clients reach into on a sharded module, with the same meaning.

``torch.distributed.pipelining`` drives each stage's FSDP itself: during the
micro-batches it turns gradient sync, resharding after backward and
``is_last_backward`` off, and after the last one (its ``REDUCE_GRAD``
action) it turns them on and calls, on ``fully_shard.state(stage_module)``:

- ``_state_ctx.all_states``: every state of the stage's tree;
- each state's ``_fsdp_param_groups[*].post_backward()``: reduce the
  gradients kept over the micro-batches (and reshard);
- ``_root_post_backward_final_callback()``: what the end of backward does
  (land the reductions, reset for the next step).

:class:`FSDPStateView` gives exactly those names over shard's
:class:`~shard_runtime._state.UnitState`, so that pipelining (and a client
calling ``module._get_fsdp_state()`` or ``fully_shard.state(module)``)
reduces once per unit per step, as on PyTorch. Nothing else of PyTorch's
private state exists here: a name that is not below is an AttributeError.
"""

from __future__ import annotations

from torch import nn

from shard_runtime._state import UnitState, get_state, states_in
from shard_runtime._unit import Unit

__all__ = ["FSDPStateView", "state_view"]


class _ParamGroupView:
    """One unit, as ``FSDPParamGroup`` is seen by pipelining.

    A state whose parameters are on several meshes has one unit per mesh
    (see [Note: one unit per process group] in ``_mesh_groups.py``), and one
    view each, as PyTorch has one parameter group each. The state reduces
    all of its units at once, so the first view's call reduces them all and
    the others' find the state reduced: still once per unit per step.
    """

    def __init__(self, state: UnitState, unit: Unit) -> None:
        self._unit_state = state
        self._unit = unit

    def post_backward(self) -> None:
        """Reduce the unit's kept gradients now (once) and free its full parameters.

        A unit that already reduced in this backward, or has nothing to
        reduce, does nothing, as PyTorch's.
        """
        self._unit_state.post_backward()


class _StateContextView:
    """The root's ``_state_ctx``: every state of its tree."""

    def __init__(self, root: UnitState) -> None:
        self._root = root

    @property
    def all_states(self) -> list[FSDPStateView]:
        states = self._root.all_states or states_in(self._root.modules)
        return [FSDPStateView(s) for s in states]


class FSDPStateView:
    """``fully_shard.state(module)`` for PyTorch's FSDP clients; see the module docstring."""

    def __init__(self, state: UnitState) -> None:
        self._unit_state = state

    @property
    def _state_ctx(self) -> _StateContextView:
        return _StateContextView(self._unit_state.root or self._unit_state)

    @property
    def _fsdp_param_groups(self) -> list[_ParamGroupView]:
        return [_ParamGroupView(self._unit_state, unit) for unit in self._unit_state.units]

    def _root_post_backward_final_callback(self) -> None:
        """End the backward now: land every reduction, reset every unit for the next step."""
        root = self._unit_state.root or self._unit_state
        root.end_of_backward()


def state_view(module: nn.Module) -> FSDPStateView:
    """``fully_shard.state(module)``: the state view of a module ``fully_shard`` sharded.

    Raises:
        ValueError: ``module`` was not passed to ``fully_shard``.
    """
    state = get_state(module)
    if state is None:
        raise ValueError(
            f"fully_shard.state: {type(module).__name__} is not sharded; pass a module "
            "fully_shard was applied to"
        )
    return FSDPStateView(state)
