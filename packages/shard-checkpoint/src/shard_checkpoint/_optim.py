"""Optimizer state dicts keyed by parameter name, for optimizers over sharded parameters.

``torch.optim`` keys state by position (parameter 0, 1, ...), which means
nothing once the model is sharded differently or the optimizer is rebuilt.
Here every entry is keyed by the parameter's qualified name in the model::

    {"state": {"blocks.0.inner.weight": {"step": tensor(3.), "exp_avg": DTensor, ...}, ...},
     "param_groups": [{"lr": 0.01, ..., "params": ["embed.weight", ...]}, ...]}

State shaped like its parameter is a DTensor laid out like the parameter
(sharded form) or a plain full tensor (full form); anything else (AdamW's
``step`` scalar) stays as the optimizer keeps it. The flat form spells the
same content ``{"state.<fqn>.<name>": ..., "param_groups.<fqn>.<option>": ...}``.

[Note: optimizer state before the first step]
``torch.optim`` creates state lazily at the first step, so a fresh optimizer
has nothing to load a checkpoint into. Both directions first run one step
with zero gradients and every learning rate set to 0 (the parameters do not
move; the state is created with the right shapes and layouts), as PyTorch's
``get_optimizer_state_dict`` does. Optimizers that already have state, or
parameters that already have gradients, are left alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shard_checkpoint._dist import broadcast_object, broadcast_tensor, rank
from shard_checkpoint._errors import StateDictError
from shard_checkpoint._model import TensorSpec, reshard_model
from shard_checkpoint._options import StateDictOptions
from shard_checkpoint._tensors import full_value, same_layout, shard_like, to_cpu

__all__ = ["get_optimizer_state_dict", "set_optimizer_state_dict"]

_STATE = "state"
_GROUPS = "param_groups"
_PARAMS = "params"

# Per fqn: {state name: value}, and per fqn: its param group's options.
_States = dict[str, dict[str, Any]]
_GroupOptions = dict[str, dict[str, Any]]


def get_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """The optimizers' state keyed by parameter name (several optimizers are merged).

    Args:
        model: the model whose parameters the optimizers hold (sharded or plain).
        optimizers: one optimizer, or several over disjoint parameters.
        options: ``full_state_dict`` gathers sharded state into plain tensors
            (a collective); ``cpu_offload`` moves values to the CPU and, with
            ``full_state_dict``, leaves every rank but 0 with ``{}``;
            ``flatten_optimizer_state_dict`` returns the flat form.

    Raises:
        StateDictError: an optimizer holds a parameter the model does not.
    """
    options = options or StateDictOptions()
    reshard_model(model)
    names = _param_names(model)
    states: _States = {}
    groups: list[dict[str, Any]] = []
    for o_index, optim in enumerate(_as_list(optimizers)):
        _init_state(optim)
        osd = optim.state_dict()
        fqn_of_index: dict[int, str] = {}
        for g_index, (group_sd, group) in enumerate(
            zip(osd[_GROUPS], optim.param_groups, strict=True)
        ):
            fqns = [_fqn(names, p, o_index, g_index, i) for i, p in enumerate(group[_PARAMS])]
            fqn_of_index.update(zip(group_sd[_PARAMS], fqns, strict=True))
            groups.append({**_group_options(group_sd), _PARAMS: fqns})
        for index, values in osd[_STATE].items():
            states[fqn_of_index[index]] = dict(values)
    # Parameter order, the same on every rank: full gathers are collectives.
    ordered = {fqn: states[fqn] for group in groups for fqn in group[_PARAMS] if fqn in states}
    if options.full_state_dict:
        keep = not options.cpu_offload or rank() == 0
        for values in ordered.values():
            for name, value in values.items():
                if isinstance(value, torch.Tensor):
                    full = full_value(value)  # every rank takes part, kept or not
                    if keep:
                        values[name] = full.cpu() if options.cpu_offload else full
                    del full
        if not keep:
            return {}
    elif options.cpu_offload:
        for values in ordered.values():
            for name, value in values.items():
                if isinstance(value, torch.Tensor):
                    values[name] = to_cpu(value)
    result = {_STATE: ordered, _GROUPS: groups}
    return _flatten(result) if options.flatten_optimizer_state_dict else result


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    optim_state_dict: Mapping[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> None:
    """Load a name-keyed optimizer state dict (nested or flat, sharded or full).

    Each parameter's state is laid out like the parameter now is: full values
    are cut into this rank's rows, DTensors sharded differently are
    resharded. Param group options come from the group that held the
    parameter in ``optim_state_dict``.

    Args:
        model: the model whose parameters the optimizers hold.
        optimizers: the optimizer(s) to load into.
        optim_state_dict: as :func:`get_optimizer_state_dict` returns it.
            With ``broadcast_from_rank0`` only rank 0's is read.
        options: ``strict`` (default) makes state for a parameter no
            optimizer holds, or a param group with none of the state dict's
            options, an error naming the parameter.

    Raises:
        StateDictError: see ``options``; also a flat key that names no
            parameter of the optimizers.
    """
    options = options or StateDictOptions()
    reshard_model(model)
    optims = _as_list(optimizers)
    names = _param_names(model)
    layout = [
        [
            [_fqn(names, p, o, g, i) for i, p in enumerate(group[_PARAMS])]
            for g, group in enumerate(optim.param_groups)
        ]
        for o, optim in enumerate(optims)
    ]
    params = {
        fqn: param
        for optim, groups in zip(optims, layout, strict=True)
        for group, fqns in zip(optim.param_groups, groups, strict=True)
        for fqn, param in zip(fqns, group[_PARAMS], strict=True)
    }
    if options.broadcast_from_rank0:
        states, group_options = _receive_from_rank0(optim_state_dict, params, options.strict)
    else:
        states, group_options = _normalize(optim_state_dict, params)
        _check_unexpected(states, params, options.strict)
        states = {
            fqn: {
                name: _like_param(f"{fqn}.{name}", value, params[fqn])
                for name, value in values.items()
            }
            for fqn, values in states.items()
            if fqn in params
        }
    for optim, groups in zip(optims, layout, strict=True):
        optim.load_state_dict(_indexed(optim, groups, states, group_options, strict=options.strict))


# ------------------------------------------------------------------ names


def _as_list(
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
) -> list[torch.optim.Optimizer]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    optims = list(optimizers)
    if not optims:
        raise ValueError("pass at least one optimizer")
    return optims


def _param_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names


def _fqn(names: Mapping[int, str], param: torch.Tensor, optim: int, group: int, index: int) -> str:
    fqn = names.get(id(param))
    if fqn is None:
        raise StateDictError(
            f"parameter {index} (shape {tuple(param.shape)}) of param group {group} of "
            f"optimizer {optim} is not a parameter of the model; build the optimizer from "
            "model.parameters() after fully_shard (an optimizer built before holds the "
            "unsharded parameters)"
        )
    return fqn


def _group_options(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != _PARAMS}


# ------------------------------------------------------------------ forms


def _flatten(nested: Mapping[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for fqn, values in nested[_STATE].items():
        for name, value in values.items():
            flat[f"{_STATE}.{fqn}.{name}"] = value
    for group in nested[_GROUPS]:
        for fqn in group[_PARAMS]:
            for option, value in _group_options(group).items():
                flat[f"{_GROUPS}.{fqn}.{option}"] = value
    return flat


def _normalize(
    osd: Mapping[str, Any], params: Mapping[str, torch.Tensor]
) -> tuple[_States, _GroupOptions]:
    """Per-parameter state and group options from either form of ``osd``."""
    if _STATE in osd and _GROUPS in osd:
        states = {str(fqn): dict(values) for fqn, values in osd[_STATE].items()}
        group_options = {
            fqn: _group_options(group) for group in osd[_GROUPS] for fqn in group[_PARAMS]
        }
        return states, group_options
    states = {}
    group_options = {}
    for key, value in osd.items():
        head, _, rest = key.partition(".")
        fqn, _, name = rest.rpartition(".")
        if head not in (_STATE, _GROUPS) or not fqn:
            raise StateDictError(
                f"optimizer state dict key {key!r} is neither nested ('state', "
                "'param_groups') nor flat ('state.<fqn>.<name>', 'param_groups.<fqn>.<option>');"
                " pass a state dict from get_optimizer_state_dict"
            )
        target = states if head == _STATE else group_options
        target.setdefault(fqn, {})[name] = value
    return states, group_options


def _check_unexpected(states: _States, params: Mapping[str, torch.Tensor], strict: bool) -> None:
    if strict:
        unexpected = [fqn for fqn in states if fqn not in params]
        if unexpected:
            raise StateDictError(
                f"set_optimizer_state_dict: the optimizer state dict has state for "
                f"{unexpected[0]!r}, which no optimizer holds ({len(unexpected)} such "
                "parameters); load a state dict of this model and optimizer, or pass "
                "options=StateDictOptions(strict=False) to ignore them"
            )


def _indexed(
    optim: torch.optim.Optimizer,
    groups: list[list[str]],
    states: _States,
    group_options: _GroupOptions,
    *,
    strict: bool,
) -> dict[str, Any]:
    """The positional state dict ``optim.load_state_dict`` takes."""
    state: dict[int, dict[str, Any]] = {}
    param_groups: list[dict[str, Any]] = []
    index = 0
    for group, fqns in zip(optim.param_groups, groups, strict=True):
        loaded = next((group_options[f] for f in fqns if f in group_options), None)
        if loaded is None:
            if strict and fqns:
                raise StateDictError(
                    f"set_optimizer_state_dict: the optimizer state dict has no param group "
                    f"holding {fqns[0]!r}; load a state dict of this model and optimizer, or "
                    "pass options=StateDictOptions(strict=False) to keep this group's options"
                )
            loaded = _group_options(group)
        ids = []
        for fqn in fqns:
            if fqn in states:
                state[index] = states[fqn]
            ids.append(index)
            index += 1
        param_groups.append({**loaded, _PARAMS: ids})
    return {_STATE: state, _GROUPS: param_groups}


def _like_param(key: str, value: Any, param: torch.Tensor) -> Any:
    """``value`` laid out like ``param`` when it has the parameter's shape; as is otherwise."""
    if not isinstance(value, torch.Tensor):
        return value
    if not isinstance(param, DTensor):
        return full_value(value)
    if isinstance(value, DTensor) and same_layout(value, param):
        return value
    if value.shape != param.shape:
        return value
    return shard_like(full_value(value), param, key=key, copy=True)


# ------------------------------------------------------------------ broadcast


def _receive_from_rank0(
    osd: Mapping[str, Any], params: Mapping[str, torch.Tensor], strict: bool
) -> tuple[_States, _GroupOptions]:
    """Rank 0's state, broadcast one tensor at a time, each laid out like its parameter."""
    skeleton: tuple[_States, _GroupOptions] | StateDictError | None = None
    if rank() == 0:
        try:
            states, group_options = _normalize(osd, params)
            skeleton = ({fqn: _specs(fqn, v) for fqn, v in states.items()}, group_options)
        except StateDictError as exc:
            skeleton = exc
    skeleton = broadcast_object(skeleton)
    if isinstance(skeleton, StateDictError):
        raise skeleton
    assert skeleton is not None
    specs, group_options = skeleton
    _check_unexpected(specs, params, strict)
    received: _States = {}
    for fqn, values in specs.items():
        param = params.get(fqn)
        if param is None:  # not strict: skipped on every rank alike
            continue
        out: dict[str, Any] = {}
        for name, spec in values.items():
            if not isinstance(spec, TensorSpec):
                out[name] = spec
                continue
            device = _local_device(param)
            if rank() == 0:
                buffer = _osd_value(osd, fqn, name).detach().to(device).contiguous()
            else:
                buffer = torch.empty(spec.shape, dtype=spec.dtype, device=device)
            broadcast_tensor(buffer, label=f"optim_state_dict ({fqn}.{name})")
            if buffer.shape == param.shape:
                out[name] = _like_param(f"{fqn}.{name}", buffer, param)
            else:
                out[name] = buffer.cpu() if spec.device_type == "cpu" else buffer
            del buffer
        received[fqn] = out
    return received, group_options


def _local_device(param: torch.Tensor) -> torch.device:
    """Where ``param``'s local data lives (its shard's device for a DTensor)."""
    return param.to_local().device if isinstance(param, DTensor) else param.device


def _specs(fqn: str, values: Mapping[str, Any]) -> dict[str, Any]:
    specs: dict[str, Any] = {}
    for name, value in values.items():
        if isinstance(value, DTensor):
            raise StateDictError(
                f"set_optimizer_state_dict: broadcast_from_rank0 expects full tensors on rank "
                f"0, but {fqn}.{name} is a DTensor; pass a full optimizer state dict "
                "(full_state_dict=True), or load sharded ones without broadcast_from_rank0"
            )
        specs[name] = (
            TensorSpec(tuple(value.shape), value.dtype, value.device.type)
            if isinstance(value, torch.Tensor)
            else value
        )
    return specs


def _osd_value(osd: Mapping[str, Any], fqn: str, name: str) -> torch.Tensor:
    """Rank 0's tensor for ``fqn``'s state ``name``, in either form."""
    value = osd[_STATE][fqn][name] if _STATE in osd else osd[f"{_STATE}.{fqn}.{name}"]
    assert isinstance(value, torch.Tensor)
    return value


# ------------------------------------------------------------------ lazy state


def _init_state(optim: torch.optim.Optimizer) -> None:
    """Create the optimizer's state by a step that moves nothing.

    See [Note: optimizer state before the first step].
    """
    if optim.state:
        return
    params = [p for group in optim.param_groups for p in group[_PARAMS]]
    if any(p.grad is not None for p in params):
        return
    saved_lrs = []
    for group in optim.param_groups:
        lr = group.get("lr")
        saved_lrs.append(lr)
        if lr is not None:
            group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
    for param in params:
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    try:
        optim.step()
    finally:
        for group, lr in zip(optim.param_groups, saved_lrs, strict=True):
            if lr is not None:
                group["lr"] = lr
        optim.zero_grad(set_to_none=True)
