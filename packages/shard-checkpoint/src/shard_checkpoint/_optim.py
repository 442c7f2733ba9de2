"""Optimizer state dicts keyed by parameter name, for optimizers over sharded parameters.

``torch.optim`` keys state by position (parameter 0, 1, ...), which means
nothing once the model is sharded differently or the optimizer is rebuilt.
Here every entry is keyed by the parameter's qualified name in the unwrapped
model::

    {"state": {"blocks.0.inner.weight": {"step": tensor(3.), "exp_avg": DTensor, ...}, ...},
     "param_groups": [{"lr": 0.01, ..., "params": ["embed.weight", ...]}, ...]}

State shaped like its parameter is a DTensor laid out like the parameter
(sharded form) or a plain full tensor (full form); anything else (AdamW's
``step`` scalar) stays as the optimizer keeps it. The flat form spells the
same content ``{"state.<fqn>.<name>": ..., "param_groups.<fqn>.<option>": ...}``.

The state of ``FullyShardedDataParallel`` units is gathered and cut in
``_optim_flat_units.py``; rekeying by position is ``_optim_rekey.py``.

[Note: flat shards in optimizer state]
A ``fully_shard`` parameter sharded with ``flat_shard_placement`` is a 1-D
DTensor of its flattened storage, and so is its elementwise optimizer
state. A state dict shows that state in the parameter's full shape instead
(the default layout's ``Shard(0)`` rows in sharded form, the full tensor in
full form), as the model state dict shows the parameter, so a checkpoint
saved flat at N ranks loads at M ranks, flat or not, and into an unsharded
model. Loading cuts this rank's flat piece back out of the full-shape value.
The conversions are ``shard_runtime._flat_placement``'s (see [Note: flat
shards in state dicts] there); each gathers the value once.

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
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shard_checkpoint._dist import broadcast_object, broadcast_tensor, rank
from shard_checkpoint._errors import StateDictError
from shard_checkpoint._model import TensorSpec, check_not_empty, reshard_model
from shard_checkpoint._optim_entries import (
    GROUPS,
    PARAMS,
    STATE,
    Entry,
    GroupOptions,
    States,
    all_entries,
    held_units,
    optimizer_entries,
    param_group_options,
)
from shard_checkpoint._optim_flat_units import agree_on_skeleton, unit_state_in, unit_state_out
from shard_checkpoint._options import (
    StateDictOptions,
    checked_options,
    warn_submodules_deprecated,
)
from shard_checkpoint._tensors import full_value, same_layout, shard_like, to_cpu
from shard_runtime.plumbing import flat_sharded_params, flat_to_rows, full_to_flat

if TYPE_CHECKING:
    from shard_runtime.plumbing import ShardedParam

__all__ = [
    "as_optimizer_list",
    "functional_optimizer_state_dict",
    "get_optimizer_state_dict",
    "given_optimizers",
    "load_functional_optimizer_state_dict",
    "optimizer_state_dict",
    "optimizer_state_dict_to_load",
    "set_optimizer_state_dict",
]


def get_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """The optimizers' state keyed by parameter name (several optimizers are merged).

    Args:
        model: the model whose parameters the optimizers hold (sharded by
            either front end, both, or plain).
        optimizers: one optimizer, or several over disjoint parameters.
        submodules: deprecated (a ``FutureWarning``); as in PyTorch it does
            not filter optimizer state: every parameter's state is returned.
        options: ``full_state_dict`` gathers sharded state into plain tensors
            (a collective); ``cpu_offload`` moves values to the CPU and, with
            ``full_state_dict``, leaves every rank but 0 with ``{}``;
            ``flatten_optimizer_state_dict`` returns the flat form.

    Raises:
        StateDictError: no optimizer is given, or an optimizer holds a
            parameter the model does not.
        ValueError: ``broadcast_from_rank0`` without ``full_state_dict``.
    """
    warn_submodules_deprecated(submodules, "get_optimizer_state_dict", stacklevel=2)
    options = checked_options(options, "get_optimizer_state_dict")
    optims = given_optimizers(optimizers, "get_optimizer_state_dict")
    return functional_optimizer_state_dict(model, optims, options)


def functional_optimizer_state_dict(
    model: nn.Module, optims: list[torch.optim.Optimizer], options: StateDictOptions
) -> dict[str, Any]:
    """:func:`get_optimizer_state_dict` after its arguments are checked (and ``get_state_dict``)."""
    result = optimizer_state_dict(
        model,
        optims,
        full=options.full_state_dict,
        offload_to_cpu=options.cpu_offload,
        rank0_only=options.full_state_dict and options.cpu_offload,
    )
    return _flatten(result) if options.flatten_optimizer_state_dict and result else result


def given_optimizers(
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer], caller: str
) -> list[torch.optim.Optimizer]:
    """``optimizers`` as a list, refusing none at all as PyTorch does (``RuntimeError``)."""
    optims = as_optimizer_list(optimizers)
    if not optims:
        raise StateDictError(
            f"{caller}: optimizers is empty; pass the optimizer (or optimizers) that "
            "optimize the model, or use get_model_state_dict/set_model_state_dict for the "
            "model alone"
        )
    return optims


def optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    full: bool,
    offload_to_cpu: bool,
    rank0_only: bool,
    local_state_dicts: list[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The nested name-keyed form; ``rank0_only`` (full only) leaves other ranks ``{}``.

    ``local_state_dicts`` replaces ``optim.state_dict()`` of each optimizer
    (the wrapper's ``optim_state_dict(model, optim, optim_state_dict)``).
    """
    reshard_model(model)
    optims = as_optimizer_list(optimizers)
    layout = optimizer_entries(model, optims)
    keep = not (full and rank0_only) or rank() == 0
    flats = flat_sharded_params(model)
    plain: States = {}
    flat_of: dict[str, ShardedParam] = {}  # See [Note: flat shards in optimizer state]
    wrapper: dict[int, dict[int | None, dict[str, Any]]] = {}  # id(unit) -> index -> state
    groups: list[dict[str, Any]] = []
    for o, (optim, entry_groups) in enumerate(zip(optims, layout, strict=True)):
        if local_state_dicts is None:
            _init_state(optim)
            osd = optim.state_dict()
        else:
            osd = dict(local_state_dicts[o])
        entry_of_index: dict[int, Entry] = {}
        for group_sd, entries in zip(osd[GROUPS], entry_groups, strict=True):
            entry_of_index.update(zip(group_sd[PARAMS], entries, strict=True))
            fqns = [fqn for entry in entries for fqn in entry.fqns]
            groups.append({**param_group_options(group_sd), PARAMS: fqns})
        for index, values in osd[STATE].items():
            entry = entry_of_index[index]
            if entry.unit is None:
                plain[entry.fqns[0]] = dict(values)
                if id(entry.param) in flats:
                    flat_of[entry.fqns[0]] = flats[id(entry.param)]
            else:
                wrapper.setdefault(id(entry.unit), {})[entry.index] = dict(values)
    states: States = {}
    units = held_units(layout)
    if units:
        skeleton = agree_on_skeleton(units, wrapper)
        for unit in units:  # the same order on every rank: gathers are collectives
            unit_state_out(
                unit, wrapper.get(id(unit), {}), skeleton, states, full, offload_to_cpu, keep
            )
    # Parameter order, the same on every rank: full gathers are collectives.
    ordered: States = {}
    for group in groups:
        for fqn in group[PARAMS]:
            if fqn in plain:
                ordered[fqn] = _plain_state_out(
                    plain[fqn], full, offload_to_cpu, keep, flat_of.get(fqn)
                )
            elif fqn in states:
                ordered[fqn] = states[fqn]
    if not units:
        # As optim.state_dict() lists it (PyTorch's too), which ``plain`` kept: by when each
        # parameter's state was created, not parameter order once one starts training late.
        ordered = {fqn: ordered[fqn] for fqn in plain if fqn in ordered}
    elif any(unit.flat_param is None for unit in units):
        # PyTorch's FSDP1 lists the state of use_orig_params=True models by parameter name,
        # the parameters outside every unit (ignored modules) first; its param_groups keep
        # the optimizer's order. A drop-in gives the same dict.
        ordered = dict(sorted(ordered.items(), key=lambda item: (item[0] in states, item[0])))
    if not keep:
        return {}
    return {STATE: ordered, GROUPS: groups}


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    optim_state_dict: Mapping[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> None:
    """Load a name-keyed optimizer state dict (nested or flat, sharded or full).

    Each parameter's state is laid out like the parameter now is: full values
    are cut into this rank's rows (or its flat shard, for wrapper units),
    DTensors sharded differently are resharded. Param group options come
    from the group that held the parameter in ``optim_state_dict``.

    Args:
        model: the model whose parameters the optimizers hold.
        optimizers: the optimizer(s) to load into.
        optim_state_dict: as :func:`get_optimizer_state_dict` returns it.
            With ``broadcast_from_rank0`` only rank 0's is read.
        options: ``strict`` (default) makes state for a parameter no
            optimizer holds, or a param group with none of the state dict's
            options, an error naming the parameter.

    Raises:
        StateDictError: see ``options``; also no optimizer, an empty state
            dict (unless rank 0 alone holds it: ``broadcast_from_rank0``, or
            ``full_state_dict`` with ``cpu_offload``), and a flat key that
            names no parameter of the optimizers.
        ValueError: ``broadcast_from_rank0`` without ``full_state_dict``.
    """
    options = checked_options(options, "set_optimizer_state_dict")
    optims = given_optimizers(optimizers, "set_optimizer_state_dict")
    load_functional_optimizer_state_dict(
        model, optims, optim_state_dict, options, "set_optimizer_state_dict"
    )


def load_functional_optimizer_state_dict(
    model: nn.Module,
    optims: list[torch.optim.Optimizer],
    optim_state_dict: Mapping[str, Any],
    options: StateDictOptions,
    caller: str,
) -> None:
    """:func:`set_optimizer_state_dict` after its arguments are checked (and ``set_state_dict``)."""
    check_not_empty(
        optim_state_dict, options, caller, "optimizer", empty_allowed=False, only_if_strict=False
    )
    loadable = optimizer_state_dict_to_load(
        model,
        optims,
        optim_state_dict,
        strict=options.strict,
        broadcast_from_rank0=options.broadcast_from_rank0,
    )
    for optim, osd in zip(optims, loadable, strict=True):
        optim.load_state_dict(osd)


def optimizer_state_dict_to_load(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    optim_state_dict: Mapping[str, Any],
    *,
    strict: bool,
    broadcast_from_rank0: bool,
) -> list[dict[str, Any]]:
    """For each optimizer, the positional state dict its ``load_state_dict`` takes."""
    reshard_model(model)
    optims = as_optimizer_list(optimizers)
    layout = optimizer_entries(model, optims)
    params = {fqn: entry for entry in all_entries(layout) for fqn in entry.fqns}
    flats = flat_sharded_params(model)
    if broadcast_from_rank0:
        specs, group_options = _skeleton_from_rank0(optim_state_dict, params)
        fetch = _Broadcast(optim_state_dict)
    else:
        specs, group_options = _normalize(optim_state_dict, params)
        fetch = None
    _check_unexpected(specs, params, strict)
    by_entry: dict[int, dict[str, Any]] = {}
    for unit in held_units(layout):
        unit_state_in(unit, layout, specs, fetch, by_entry)
    for entry in all_entries(layout):
        fqn = entry.fqns[0]
        if entry.unit is not None or fqn not in specs:
            continue
        out: dict[str, Any] = {}
        for name, value in specs[fqn].items():
            if fetch is not None and isinstance(value, TensorSpec):
                received = fetch(fqn, name, value, _local_device(entry.param))
                on_cpu = value.device_type == "cpu" and received.shape != entry.param.shape
                value = received.cpu() if on_cpu else received
            out[name] = _like_param(f"{fqn}.{name}", value, entry.param, flats.get(id(entry.param)))
        by_entry[id(entry.param)] = out
    return [
        _indexed(optim, groups, by_entry, group_options, strict=strict)
        for optim, groups in zip(optims, layout, strict=True)
    ]


# ------------------------------------------------------------------ plain parameters


def _plain_state_out(
    values: dict[str, Any],
    full: bool,
    offload_to_cpu: bool,
    keep: bool,
    flat: ShardedParam | None = None,
) -> dict[str, Any]:
    """A fully_shard or plain parameter's state in the requested form.

    ``flat``: the parameter is sharded flat; its elementwise state is shown
    in the full shape. See [Note: flat shards in optimizer state].
    """
    out: dict[str, Any] = {}
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            if (
                flat is not None
                and isinstance(value, DTensor)
                and value.shape == flat.dtensor_shape
                and value.shape != flat.full_shape
            ):
                value = flat_to_rows(flat, value)  # every rank takes part
            if full:
                value = full_value(value)  # every rank takes part, kept or not
                value = value.cpu() if offload_to_cpu else value
            elif offload_to_cpu:
                value = to_cpu(value)
        if keep:
            out[name] = value
    return out


def _like_param(key: str, value: Any, param: torch.Tensor, flat: ShardedParam | None = None) -> Any:
    """``value`` laid out like ``param`` when it has the parameter's shape; as is otherwise.

    ``flat``: ``param`` is a flat shard; a value of the parameter's full shape
    becomes this rank's flat piece. See [Note: flat shards in optimizer state].
    """
    if not isinstance(value, torch.Tensor):
        return value
    if flat is not None and value.shape == flat.full_shape != flat.dtensor_shape:
        return full_to_flat(flat, value)
    if not isinstance(param, DTensor):
        return full_value(value)
    if isinstance(value, DTensor) and same_layout(value, param):
        return value
    if value.shape != param.shape:
        return value
    return shard_like(full_value(value), param, key=key, copy=True)


# ------------------------------------------------------------------ optimizers


def as_optimizer_list(
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
) -> list[torch.optim.Optimizer]:
    """One optimizer or an iterable of them (a generator too, read once) as a list."""
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    return list(optimizers)


# ------------------------------------------------------------------ forms


def _flatten(nested: Mapping[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for fqn, values in nested[STATE].items():
        for name, value in values.items():
            flat[f"{STATE}.{fqn}.{name}"] = value
    for group in nested[GROUPS]:
        for fqn in group[PARAMS]:
            for option, value in param_group_options(group).items():
                flat[f"{GROUPS}.{fqn}.{option}"] = value
    return flat


def _normalize(osd: Mapping[str, Any], params: Mapping[str, Entry]) -> tuple[States, GroupOptions]:
    """Per-parameter state and group options from either form of ``osd``."""
    if STATE in osd and GROUPS in osd:
        states = {str(fqn): dict(values) for fqn, values in osd[STATE].items()}
        group_options = {
            fqn: param_group_options(group) for group in osd[GROUPS] for fqn in group[PARAMS]
        }
        return states, group_options
    states = {}
    group_options = {}
    for key, value in osd.items():
        head, _, rest = key.partition(".")
        fqn, _, name = rest.rpartition(".")
        if head not in (STATE, GROUPS) or not fqn:
            raise StateDictError(
                f"optimizer state dict key {key!r} is neither nested ('state', "
                "'param_groups') nor flat ('state.<fqn>.<name>', 'param_groups.<fqn>.<option>');"
                " pass a state dict from get_optimizer_state_dict"
            )
        target = states if head == STATE else group_options
        target.setdefault(fqn, {})[name] = value
    return states, group_options


def _check_unexpected(states: States, params: Mapping[str, Entry], strict: bool) -> None:
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
    groups: list[list[Entry]],
    by_entry: Mapping[int, dict[str, Any]],
    group_options: GroupOptions,
    *,
    strict: bool,
) -> dict[str, Any]:
    """The positional state dict ``optim.load_state_dict`` takes."""
    state: dict[int, dict[str, Any]] = {}
    param_groups: list[dict[str, Any]] = []
    index = 0
    for group, entries in zip(optim.param_groups, groups, strict=True):
        fqns = [fqn for entry in entries for fqn in entry.fqns]
        loaded = next((group_options[f] for f in fqns if f in group_options), None)
        if loaded is None:
            if strict and fqns:
                raise StateDictError(
                    f"set_optimizer_state_dict: the optimizer state dict has no param group "
                    f"holding {fqns[0]!r}; load a state dict of this model and optimizer, or "
                    "pass options=StateDictOptions(strict=False) to keep this group's options"
                )
            loaded = param_group_options(group)
        ids = []
        for entry in entries:
            if id(entry.param) in by_entry:
                state[index] = by_entry[id(entry.param)]
            ids.append(index)
            index += 1
        param_groups.append({**loaded, PARAMS: ids})
    return {STATE: state, GROUPS: param_groups}


# ------------------------------------------------------------------ broadcast


def _skeleton_from_rank0(
    osd: Mapping[str, Any], params: Mapping[str, Entry]
) -> tuple[States, GroupOptions]:
    """Rank 0's state with every tensor replaced by its :class:`TensorSpec`, on every rank."""
    skeleton: tuple[States, GroupOptions] | StateDictError | None = None
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
    return skeleton


class _Broadcast:
    """Rank 0's full tensors, one per call, in the order every rank asks for them."""

    def __init__(self, osd: Mapping[str, Any]) -> None:
        self.osd = osd

    def __call__(self, fqn: str, name: str, spec: TensorSpec, device: torch.device) -> torch.Tensor:
        if rank() == 0:
            buffer = _osd_value(self.osd, fqn, name).detach().to(device).contiguous()
        else:
            buffer = torch.empty(spec.shape, dtype=spec.dtype, device=device)
        return broadcast_tensor(buffer, label=f"optim_state_dict ({fqn}.{name})")


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
    value = osd[STATE][fqn][name] if STATE in osd else osd[f"{STATE}.{fqn}.{name}"]
    assert isinstance(value, torch.Tensor)
    return value


# ------------------------------------------------------------------ lazy state


def _init_state(optim: torch.optim.Optimizer) -> None:
    """Create the optimizer's state by a step that moves nothing.

    See [Note: optimizer state before the first step].
    """
    if optim.state:
        return
    params = [p for group in optim.param_groups for p in group[PARAMS]]
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
