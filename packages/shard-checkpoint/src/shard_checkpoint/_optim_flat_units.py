"""The optimizer state of ``FullyShardedDataParallel`` units, gathered and cut per parameter.

[Note: wrapper units in optimizer state]
An optimizer over a ``FullyShardedDataParallel`` unit holds either the
unit's flat shard (``use_orig_params=False``: one parameter, one flat state
tensor per state name) or each original parameter's 1-D piece of it
(``use_orig_params=True``; a rank holds state only for the parameters its
shard touches; a shard axis of one rank gives the whole parameter in its own
shape, as PyTorch does). Either way a state name of the unit is one flat tensor per
rank, laid out like the parameters: it is gathered over the unit's shard
axis and viewed per parameter (``_flat.py``), and loading cuts this rank's
flat shard back out of per-parameter full values. Because ranks hold state
for different parameters, one ``all_gather_object`` first agrees on each
parameter's state names, dtypes and scalars. Only elementwise state (shaped
like the parameter) and scalars can live in a flat shard.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shard_checkpoint._dist import all_gather_objects
from shard_checkpoint._errors import StateDictError
from shard_checkpoint._flat import gathered_copies
from shard_checkpoint._model import TensorSpec
from shard_checkpoint._optim_entries import Entry, States, all_entries
from shard_checkpoint._tensors import full_value
from shard_runtime.plumbing import FlatUnit

__all__ = ["Fetch", "agree_on_skeleton", "unit_state_in", "unit_state_out"]

# Rank 0's full tensor of (fqn, state name), received on every rank (``broadcast_from_rank0``).
Fetch = Callable[[str, str, TensorSpec, torch.device], torch.Tensor]


@dataclass(frozen=True, slots=True)
class _FlatState:
    """A wrapper unit's elementwise state name, in the skeleton ranks agree on."""

    dtype: torch.dtype


_Skeleton = dict[str, dict[str, Any]]  # fqn -> state name -> _FlatState | scalar value


def agree_on_skeleton(
    units: list[FlatUnit], held: Mapping[int, Mapping[int | None, Mapping[str, Any]]]
) -> _Skeleton:
    """Every wrapper parameter's state names, flat dtypes and scalars, merged over all ranks."""
    local: _Skeleton = {}
    for unit in units:
        states = held.get(id(unit), {})
        if unit.flat_param is not None:
            values = states.get(None)
            if values:
                shape = _describe(unit.params[0].keys[0], values, (unit.shard_numel,))
                for param in unit.params:
                    local[param.keys[0]] = shape
            continue
        for info in unit.meta.params:
            values = states.get(info.index)
            if values:
                held_param = unit.params[info.index].param
                assert held_param is not None
                fqn = unit.params[info.index].keys[0]
                local[fqn] = _describe(fqn, values, tuple(held_param.shape))
    merged: _Skeleton = {}
    for theirs in all_gather_objects(local):
        for fqn, names in theirs.items():
            mine = merged.setdefault(fqn, {})
            for name, value in names.items():
                mine.setdefault(name, value)
    return merged


def _describe(fqn: str, values: Mapping[str, Any], shape: tuple[int, ...]) -> dict[str, Any]:
    """A wrapper parameter's state with flat tensors replaced by their dtype.

    ``shape`` is the shape of what the optimizer holds: the flat shard, a 1-D
    piece of it, or (``use_orig_params`` on one rank) the whole parameter.
    """
    out: dict[str, Any] = {}
    for name, value in values.items():
        if not isinstance(value, torch.Tensor):
            out[name] = value
        elif value.dim() == 0:
            out[name] = value.detach().clone()
        elif tuple(value.shape) == shape:
            out[name] = _FlatState(value.dtype)
        else:
            raise _not_elementwise(fqn, name, tuple(value.shape))
    return out


def _not_elementwise(fqn: str, name: str, shape: tuple[int, ...]) -> StateDictError:
    return StateDictError(
        f"optimizer state {fqn}.{name} has shape {shape}, neither a scalar nor laid out like "
        "the parameter: FullyShardedDataParallel units keep parameters in flat shards, which "
        "hold elementwise optimizer state only (Adam, SGD momentum, ...); shard this part of "
        "the model with fully_shard to use this optimizer"
    )


def unit_state_out(
    unit: FlatUnit,
    held: Mapping[int | None, Mapping[str, Any]],
    skeleton: _Skeleton,
    states: States,
    full: bool,
    offload_to_cpu: bool,
    keep: bool,
) -> None:
    """Add the unit's parameters' state to ``states``, one gathered state name at a time."""
    fqns = [param.keys[0] for param in unit.params]
    dtypes: dict[str, torch.dtype] = {}
    for fqn in fqns:
        for name, value in skeleton.get(fqn, {}).items():
            if isinstance(value, _FlatState):
                dtypes.setdefault(name, value.dtype)
    values: dict[str, dict[str, torch.Tensor]] = {}
    for name, dtype in dtypes.items():
        local = _local_flat_state(unit, held, name, dtype)
        wanted = [i for i, fqn in enumerate(fqns) if keep and name in skeleton.get(fqn, {})]
        copies = gathered_copies(
            unit,
            local,
            label=f"optim_state_dict ({fqns[0]}.{name})",
            full=full,
            offload_to_cpu=offload_to_cpu,
            wanted=wanted,
        )
        for index, value in copies.items():
            values.setdefault(fqns[index], {})[name] = value
        del local
    if keep:
        for fqn in fqns:
            if fqn in skeleton:
                entry = skeleton[fqn]
                order = _flat_unit_order(entry) if unit.flat_param is not None else list(entry)
                states[fqn] = {
                    name: values[fqn][name] if isinstance(entry[name], _FlatState) else entry[name]
                    for name in order
                }


def _flat_unit_order(entry: Mapping[str, Any]) -> list[str]:
    """A flat parameter's state names as PyTorch's FSDP1 lists them when it unflattens them.

    Elementwise state first, then 0-dim tensors (Adam's ``step``), then other
    values, each in the optimizer's order: a drop-in's dict iterates alike.
    """

    def rank(name: str) -> int:
        value = entry[name]
        return 0 if isinstance(value, _FlatState) else 1 if isinstance(value, torch.Tensor) else 2

    return sorted(entry, key=rank)


def _local_flat_state(
    unit: FlatUnit, held: Mapping[int | None, Mapping[str, Any]], name: str, dtype: torch.dtype
) -> torch.Tensor:
    """This rank's flat tensor of state ``name`` (zeros where it holds none)."""
    device = unit.shard.device
    if unit.flat_param is not None:
        value = held.get(None, {}).get(name)
        if isinstance(value, torch.Tensor):
            return value.detach()
        return torch.zeros(unit.shard_numel, dtype=dtype, device=device)
    local = torch.zeros(unit.shard_numel, dtype=dtype, device=device)
    for info in unit.meta.params:
        value = held.get(info.index, {}).get(name)
        if isinstance(value, torch.Tensor):
            local.narrow(0, info.offset_in_range, info.numel_in_range).copy_(value.reshape(-1))
    return local


def unit_state_in(
    unit: FlatUnit,
    layout: list[list[list[Entry]]],
    specs: States,
    fetch: Fetch | None,
    by_entry: dict[int, dict[str, Any]],
) -> None:
    """Cut this rank's flat state of ``unit`` out of per-parameter values, one name at a time."""
    fqns = [param.keys[0] for param in unit.params]
    flat_names: list[str] = []
    for fqn, param in zip(fqns, unit.params, strict=True):
        for name, value in specs.get(fqn, {}).items():
            shape = tuple(value.shape) if isinstance(value, (torch.Tensor, TensorSpec)) else ()
            if shape == tuple(param.shape) and shape != ():
                if name not in flat_names:
                    flat_names.append(name)
            elif shape != ():
                raise _not_elementwise(fqn, name, shape)
    shard = unit.shard
    flat: dict[str, torch.Tensor] = {}
    for name in flat_names:
        fulls: list[torch.Tensor | None] = []
        for fqn in fqns:
            value = specs.get(fqn, {}).get(name)
            if value is None:
                fulls.append(None)
            elif fetch is not None:
                fulls.append(fetch(fqn, name, value, unit.compute_device))
            else:
                fulls.append(full_value(value))
        dtype = next(v.dtype for v in fulls if v is not None)
        tensors = [
            (v if v is not None else torch.zeros(p.shape, dtype=dtype)).to(shard.device, dtype)
            for v, p in zip(fulls, unit.params, strict=True)
        ]
        flat[name] = unit.layout.shard(tensors, unit.rank, unit.world)
        del fulls, tensors
    scalars: dict[str, dict[str, Any]] = {}
    for fqn in fqns:
        for name, value in specs.get(fqn, {}).items():
            if name in flat_names:
                continue
            if fetch is not None and isinstance(value, TensorSpec):
                received = fetch(fqn, name, value, unit.compute_device)
                value = received.cpu() if value.device_type == "cpu" else received
            scalars.setdefault(fqn, {})[name] = value
    pieces = {info.index: info for info in unit.meta.params}
    for entry in all_entries(layout):
        if entry.unit is None or entry.unit.wrapper is not unit.wrapper:
            continue
        if entry.index is None:
            first = next((f for f in fqns if f in specs), None)
            if first is None:
                continue
            order = list(specs[first])
            state = {n: _copy(scalars.get(first, {}).get(n)) for n in order if n not in flat}
            state.update({n: flat[n] for n in flat})
            by_entry[id(entry.param)] = {n: state[n] for n in [*order, *flat] if n in state}
            continue
        fqn = fqns[entry.index]
        info = pieces.get(entry.index)
        if info is None or fqn not in specs:
            continue
        by_entry[id(entry.param)] = {
            name: (
                flat[name]
                .narrow(0, info.offset_in_range, info.numel_in_range)
                .reshape(entry.param.shape)  # 1-D, or the full shape on one rank
                .clone()
                if name in flat
                else _copy(scalars[fqn][name])
            )
            for name in specs[fqn]
            if name in flat or name in scalars.get(fqn, {})
        }


def _copy(value: Any) -> Any:
    """A scalar state value of its own (optimizers update ``step`` tensors in place)."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value
