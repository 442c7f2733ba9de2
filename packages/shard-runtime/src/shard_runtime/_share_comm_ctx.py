"""``share_comm_ctx``: several ``fully_shard`` roots bounding their reductions in flight together.

See [Note: Sharing the communication context] in ``_comm.py``.
"""

from __future__ import annotations

import torch

from shard_runtime._fully_shard import FSDPModule
from shard_runtime._state import UnitState, get_state, states_in

__all__ = ["share_comm_ctx"]


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Give the roots ``modules`` (``fully_shard``-ed, e.g. pipeline stages) one comm context.

    Their reductions in flight then share one bound (see [Note: Sharing the
    communication context]); the communication streams are already one pair
    per device type per process. An empty list does nothing.

    Raises:
        ValueError: an element is not a module ``fully_shard`` was applied to.
    """
    states: list[UnitState] = []
    for module in modules:
        state = get_state(module) if isinstance(module, torch.nn.Module) else None
        if not isinstance(module, FSDPModule) or state is None:
            raise ValueError(
                f"share_comm_ctx: expects a list of FSDPModules (modules fully_shard was "
                f"applied to) but got {type(module).__name__}; call fully_shard on it first"
            )
        states.append(state)
    if not states:
        return
    shared = states[0].comm_ctx
    for state in states_in([module for root in states for module in root.modules]):
        for unit in state.units:
            if unit.comm_ctx is not shared:
                unit.comm_ctx.land()
                unit.comm_ctx = shared
