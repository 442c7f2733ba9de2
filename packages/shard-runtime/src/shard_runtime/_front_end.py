"""The rules a front end hands the engine: what differs between ``fully_shard`` and the wrapper.

The engine (:class:`~shard_runtime._state.UnitState` deciding when,
:class:`~shard_runtime._unit.Unit` how) is shared by both front ends and
branches on none of them. Where the two copy different PyTorch behaviour,
each front end says which it wants in one :class:`FrontEndRules`, built
where the front end builds its units; see [Note: the root] in ``_state.py``
for the root rules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["BackwardPrefetchMode", "FrontEndRules"]

BackwardPrefetchMode = Literal["pre", "post", "none"]


def _same_name(name: str) -> str:
    return name


@dataclass(frozen=True, slots=True)
class FrontEndRules:
    """What one front end decides for the units it builds.

    Attributes:
        api: the front end's name, as the user called it; it starts the
            engine's error messages (``"fully_shard"``, ``"FullyShardedDataParallel"``).
        early_forward_is_error: a sharded submodule's forward before its
            root's first forward is an error (the wrapper). Otherwise
            (``fully_shard``) the submodule becomes the root of its own
            subtree, and the real root's first forward fails later.
        root_keeps_params_for_backward: the root keeps its full parameters
            after a forward with grad enabled whatever its
            ``reshard_after_forward`` says (the wrapper); ``fully_shard``
            follows the field (``None`` there is resolved at lazy init).
        clean_name: a qualified name under the root as messages and profiles
            show it (the wrapper strips its ``_fsdp_wrapped_module`` segments).
        backward_prefetch: when the unit that runs backward next starts its
            all-gather: before this unit's backward (``"pre"``), after it
            (``"post"``), or not (``"none"``); explicit
            ``set_modules_to_backward_prefetch`` lists win.
        forward_prefetch: in forward, start the all-gather of the unit that
            ran next in the previous iteration (the wrapper's ``forward_prefetch``).
        limit_all_gathers: at most two units' all-gathers in flight.
        cast_root_inputs: the root casts its forward inputs to the parameter
            dtype (the wrapper's ``cast_root_forward_inputs``).
        average_per_collective: on a 2-D mesh, float32 and bfloat16
            gradients are averaged inside each collective (``fully_shard``),
            not once over every data-parallel rank (the wrapper); see [Note:
            Averaging per collective] in ``_unit.py``.
    """

    api: str
    early_forward_is_error: bool = False
    root_keeps_params_for_backward: bool = False
    clean_name: Callable[[str], str] = _same_name
    backward_prefetch: BackwardPrefetchMode = "pre"
    forward_prefetch: bool = False
    limit_all_gathers: bool = False
    cast_root_inputs: bool = False
    average_per_collective: bool = True
