"""The model state dicts of ``FullyShardedDataParallel``, served through the plugin registry.

The wrapper lives below this package, so it cannot import it; it asks the
registry for a :class:`~shard_core.protocols.StateDictBackend` and this
module answers (``shard_checkpoint.plugin``). Keys are the original
parameter names, never the wrapper's ``_fsdp_wrapped_module`` segments or
its ``_flat_param``, so a state dict of a wrapped model is the one of the
plain model.

[Note: one unit at a time]
Each unit's flat buffer is gathered on its own (``summon_full_params`` with
``recurse=False``), its parameters are copied out (a full value, or for
sharded state dicts this rank's ``torch.chunk`` rows as a ``Shard(0)``
DTensor) and the buffer is freed before the next unit: beyond what the
state dict itself holds, a rank holds one unit's full parameters.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from shard_checkpoint._dist import rank
from shard_checkpoint._errors import StateDictError
from shard_checkpoint._tensors import contiguous_stride, full_value
from shard_core import dim0_chunk_range
from shard_runtime import FullyShardedDataParallel
from shard_runtime._flat_param import FlatParamGroup
from shard_runtime._state import ShardState, clean_fqn, get_state

__all__ = ["WrapperStateDictBackend", "is_wrapper_model"]

_FULL = "FULL_STATE_DICT"
_SHARDED = "SHARDED_STATE_DICT"
_FLAT_PARAM = "_flat_param"


def is_wrapper_model(model: nn.Module) -> bool:
    """Whether ``model`` is the outermost ``FullyShardedDataParallel`` of its tree."""
    if not isinstance(model, FullyShardedDataParallel):
        return False
    state = get_state(model)
    return state is not None and state.parent is None


class WrapperStateDictBackend:
    """Full and sharded model state dicts of ``FullyShardedDataParallel`` (see the module doc)."""

    def model_state_dict(
        self,
        module: nn.Module,
        state_dict_type: str,
        *,
        offload_to_cpu: bool,
        rank0_only: bool,
    ) -> dict[str, Any]:
        """``module``'s state dict: full plain tensors, or ``Shard(0)`` DTensors when sharded."""
        kind = _check_type(state_dict_type)
        keep = kind == _SHARDED or not rank0_only or rank() == 0
        out: dict[str, Any] = {}
        for state, params in _units(module):
            with FullyShardedDataParallel.summon_full_params(
                state.modules[0],
                recurse=False,
                writeback=False,
                rank0_only=rank0_only and kind == _FULL,
                offload_to_cpu=offload_to_cpu and kind == _FULL,
            ):
                if not keep:
                    continue
                for key, owner, name in params:
                    full = getattr(owner, name).detach()
                    if kind == _FULL:
                        out[key] = full.clone()
                    else:
                        out[key] = _chunk(full, state, offload_to_cpu)
        managed = {key for _, params in _units(module) for key, _, _ in params}
        for key, value in nn.Module.state_dict(module).items():
            if key in managed or _is_flat(key) or not keep:
                continue
            out[key] = value.cpu() if offload_to_cpu and isinstance(value, torch.Tensor) else value
        return _in_module_order(module, out, managed)

    def load_model_state_dict(
        self,
        module: nn.Module,
        state_dict: Mapping[str, Any],
        state_dict_type: str,
        *,
        strict: bool,
    ) -> tuple[list[str], list[str]]:
        """Load full or sharded values into ``module``'s shards, one unit at a time."""
        _check_type(state_dict_type)
        units = list(_units(module))
        managed = [key for _, params in units for key, _, _ in params]
        rest = {
            k: v for k, v in nn.Module.state_dict(module, keep_vars=True).items() if not _is_flat(k)
        }
        rest = {k: v for k, v in rest.items() if k not in set(managed)}
        expected = managed + list(rest)
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in set(expected)]
        if strict and (missing or unexpected):
            culprit = (
                f"has no value for {missing[0]!r}"
                if missing
                else f"has a value for {unexpected[0]!r}, which the model does not have"
            )
            raise StateDictError(
                f"FullyShardedDataParallel.load_state_dict: the state dict {culprit} "
                f"({len(missing)} missing, {len(unexpected)} unexpected keys); load a state dict "
                "of this model, or pass strict=False"
            )
        for state, params in units:
            values = {key: full_value(state_dict[key]) for key, _, _ in params if key in state_dict}
            if not values:
                continue
            with (
                FullyShardedDataParallel.summon_full_params(
                    state.modules[0], recurse=False, writeback=True
                ),
                torch.no_grad(),
            ):
                for key, owner, name in params:
                    if key in values:
                        target = getattr(owner, name)
                        if tuple(values[key].shape) != tuple(target.shape):
                            raise StateDictError(
                                f"FullyShardedDataParallel.load_state_dict: {key!r} has shape "
                                f"{tuple(values[key].shape)} in the state dict but "
                                f"{tuple(target.shape)} in the model; load a state dict of this "
                                "model"
                            )
                        target.copy_(values[key])
            del values
        others = {k: full_value(v) for k, v in state_dict.items() if k in rest}
        with torch.no_grad():
            nn.Module.load_state_dict(module, others, strict=False)
        return missing, unexpected


def _check_type(state_dict_type: str) -> str:
    if state_dict_type not in (_FULL, _SHARDED):
        raise ValueError(
            f"shard-checkpoint serves FULL_STATE_DICT and SHARDED_STATE_DICT, got "
            f"{state_dict_type!r}; LOCAL_STATE_DICT is the wrapper's own"
        )
    return state_dict_type


def _is_flat(key: str) -> bool:
    return key == _FLAT_PARAM or key.endswith("." + _FLAT_PARAM)


def _units(model: nn.Module) -> Iterator[tuple[ShardState, list[tuple[str, nn.Module, str]]]]:
    """Each unit of ``model`` with its parameters: (key in the state dict, owner, attribute)."""
    names = {id(m): clean_fqn(n) for n, m in model.named_modules(remove_duplicate=False)}
    seen: set[int] = set()
    for wrapper in FullyShardedDataParallel.fsdp_modules(model):
        state = get_state(wrapper)
        if state is None or id(state) in seen:
            continue
        seen.add(id(state))
        group = state.unit.group
        if group.is_empty or not isinstance(group, FlatParamGroup):
            continue
        params = [
            (_join(names[id(owner.module)], owner.name), owner.module, owner.name)
            for spec in group.specs
            for owner in spec.owners
        ]
        yield state, params


def _in_module_order(model: nn.Module, state: dict[str, Any], managed: set[str]) -> dict[str, Any]:
    """``state`` in the plain model's order: module by module, parameters before buffers."""
    order: dict[str, int] = {}
    for name, _ in model.named_modules(remove_duplicate=False):
        order.setdefault(clean_fqn(name), len(order))

    def rank_of(key: str) -> tuple[int, int]:
        return order.get(key.rpartition(".")[0], len(order)), 0 if key in managed else 1

    return {key: state[key] for key in sorted(state, key=rank_of)}


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _chunk(full: torch.Tensor, state: ShardState, offload_to_cpu: bool) -> DTensor:
    """This rank's ``torch.chunk`` rows of ``full`` as a DTensor over the unit's mesh."""
    mesh = state.unit.mesh
    world = mesh.size(-1)
    rows = dim0_chunk_range(full.shape[0], mesh.get_local_rank(mesh.ndim - 1), world)
    local = full.narrow(0, rows.start, len(rows)).clone()
    if offload_to_cpu:
        local = local.cpu()
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    return DTensor.from_local(
        local,
        mesh,
        placements,
        run_check=False,
        shape=full.shape,
        stride=contiguous_stride(full.shape),
    )
