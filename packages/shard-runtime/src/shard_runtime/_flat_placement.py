"""``flat_shard_placement``: shard a parameter on its flattened storage, 1/N at any world size.

The default layout splits dim 0 into ``ceil(dim0 / n)`` rows per rank, so a
matrix whose dim 0 does not divide by the world size costs every rank up to a
whole row more than ``numel / n`` (GPT-2 XL's shapes: every rank holds 1.16x
the ideal at 1024 ranks, 1.0001x flat). The flat layout splits the parameter's flattened storage
into ``ceil(numel / n)`` elements per rank instead, which wastes less than one
element per rank and parameter.

[Note: flat shards as 1-D DTensors]
A flat shard of a ``(rows, cols)`` matrix is not a block of rows, so no DTensor
placement of the full shape describes it (``Shard`` and ``_StridedShard`` both
cut along a dim), and a wrapper that claims the full shape over a flat local
tensor would have to teach every DTensor op (the optimizer's foreach kernels,
``clip_grad_norm_``, DCP's planner) a layout torch 2.13 does not have. The
honest representation is the DTensor the data really is: the parameter's
flattened view, ``(numel,)``, placed ``Shard(0)``. The optimizer works on it
elementwise (AdamW, SGD: same update as on the full shape); the unsharded face
the module computes with keeps the full shape, and gradients are flattened
before the reduce-scatter. A parameter whose dim 0 divides evenly, a 1-D
parameter (flat is dim 0 there), a tensor-parallel DTensor and a tensor
subclass (torchao's NF4 and float8 weights shard by their own ops, which
split rows, and gather through their own hooks) keep ``Shard(0)``: no
waste, no new shape. The price: between steps
``module.weight`` of a flat parameter is that 1-D DTensor, so code that reads
its shape then (``nn.Linear.reset_parameters`` after meta-device init needs
fan-in) must run before ``fully_shard``, or the values come in through a full
state dict (``set_model_state_dict(..., full_state_dict=True)`` or
``load_state_dict``; see the next note).

[Note: flat shards in state dicts]
Checkpoints must not see the ``(numel,)`` shape: ``model.state_dict()`` would
then disagree with the unsharded model's and a checkpoint saved flat at N
ranks could not load at M. A state-dict hook on each owning module therefore
turns a flat shard into the default layout's DTensor (full shape, ``Shard(0)``
rows of this rank), which needs one all-gather of that parameter while the
state dict is built (transient: one parameter at a time). A load pre-hook does
the reverse from any full-shape tensor or DTensor, so DCP and
``load_state_dict`` see the full shapes and the unwrapped names both ways.
The optimizer's state lives in the flat shape (elementwise states of the
flat DTensor parameter); its state dicts must not show it either, for the
same reason: shard-checkpoint's optimizer state dicts turn each flat state
tensor into the default layout with :func:`flat_to_rows` and load full-shape
values back with :func:`full_to_flat`, finding the flat parameters of a
model with :func:`flat_sharded_params`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shard_runtime._dtensor import contiguous_dtensor

if TYPE_CHECKING:
    from shard_runtime._param import ShardedParam

__all__ = [
    "FlatShard",
    "flat_shard_placement",
    "flat_sharded_params",
    "flat_to_rows",
    "full_to_flat",
    "is_flat_layout",
    "register_flat_state_dict_hooks",
    "shard_numel",
]


@dataclass(frozen=True, slots=True)
class FlatShard:
    """What :func:`flat_shard_placement` returns: shard on the flattened storage if it helps."""

    def __repr__(self) -> str:
        return "FlatShard()"


def flat_shard_placement(param: nn.Parameter) -> FlatShard:
    """A ``shard_placement_fn`` for ``fully_shard``: every rank holds ~``numel / n`` elements.

    Use as ``fully_shard(block, shard_placement_fn=flat_shard_placement)``.
    ``fully_shard`` applies the flat layout only where dim 0 does not divide
    by the world size (see [Note: flat shards as 1-D DTensors]).
    """
    del param
    return FlatShard()


def is_flat_layout(shape: Sequence[int], world: int, *, tensor_parallel: bool = False) -> bool:
    """Whether a parameter of ``shape`` asking for :class:`FlatShard` is sharded flat."""
    return not tensor_parallel and len(shape) >= 2 and shape[0] % world != 0


def shard_numel(shape: Sequence[int], world: int, *, flat: bool) -> int:
    """Elements per rank including padding (what each rank contributes to an all-gather)."""
    if flat and is_flat_layout(shape, world):
        return math.ceil(math.prod(shape) / world)
    if not shape:
        return 1
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def register_flat_state_dict_hooks(sp: ShardedParam) -> None:
    """Make ``state_dict`` / ``load_state_dict`` show ``sp`` in its full shape.

    See [Note: flat shards in state dicts].
    """
    for owner in sp.owners:
        module = owner.module
        module._register_state_dict_hook(  # type: ignore[no-untyped-call]
            functools.partial(_to_rows, sp, owner.name)
        )
        module._register_load_state_dict_pre_hook(  # type: ignore[no-untyped-call]
            functools.partial(_from_full, sp, owner.name)
        )


def _row_range(sp: ShardedParam) -> tuple[int, int]:
    rows = sp.full_shape[0]
    per_rank = math.ceil(rows / sp.shard_world)
    start = min(sp.shard_rank * per_rank, rows)
    return start, min(per_rank, rows - start)


def _to_rows(
    sp: ShardedParam,
    name: str,
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: object,
) -> None:
    """State-dict hook: the flat shard becomes this rank's ``Shard(0)`` rows of the full shape."""
    key = prefix + name
    value = state_dict.get(key)
    if not isinstance(value, DTensor) or tuple(value.shape) == tuple(sp.full_shape):
        return
    state_dict[key] = flat_to_rows(sp, value)


def flat_sharded_params(module: nn.Module) -> dict[int, ShardedParam]:
    """Every flat-sharded parameter under ``module``, by ``id`` of its current sharded DTensor.

    Looked up when asked (the engine may replace a parameter object), so the
    keys are the objects an optimizer built now holds. The state-dict hooks
    of :func:`register_flat_state_dict_hooks` are the record: no registry of
    its own that could keep a model alive.
    """
    found: dict[int, ShardedParam] = {}
    for sub in module.modules():
        for hook in sub._state_dict_hooks.values():
            if isinstance(hook, functools.partial) and hook.func is _to_rows:
                sp: ShardedParam = hook.args[0]
                found[id(sp.sharded_param)] = sp
    return found


def flat_to_rows(sp: ShardedParam, value: DTensor) -> DTensor:
    """A tensor laid out like ``sp``'s flat shard as this rank's ``Shard(0)`` rows, full shape.

    For the parameter and for elementwise optimizer state alike (same shape
    and placements); one all-gather of ``value``, transient.
    """
    full = value.full_tensor().detach().view(sp.full_shape)
    start, length = _row_range(sp)
    return contiguous_dtensor(
        full.narrow(0, start, length).clone(), sp.dtensor_mesh, sp.placements, sp.full_shape
    )


def full_to_flat(sp: ShardedParam, value: torch.Tensor) -> DTensor:
    """A full-shape tensor or DTensor (any layout) as this rank's flat shard, laid out like ``sp``.

    The inverse of :func:`flat_to_rows`; a DTensor is gathered first (a
    collective). The result has its own storage on the shard's device.
    """
    full = value.full_tensor() if isinstance(value, DTensor) else value
    start = min(sp.shard_rank * sp.padded_rows, full.numel())
    local = full.detach().reshape(-1).narrow(0, start, sp.local_rows)
    return contiguous_dtensor(
        local.to(sp.padded_shard.device, copy=True),
        sp.dtensor_mesh,
        sp.placements,
        sp.dtensor_shape,
    )


def _from_full(
    sp: ShardedParam,
    name: str,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: object,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Load pre-hook: a full-shape tensor or DTensor becomes this rank's flat shard."""
    key = prefix + name
    value = state_dict.get(key)
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(sp.full_shape):
        return  # missing or already flat: the default load reports or copies it
    state_dict[key] = full_to_flat(sp, value)
