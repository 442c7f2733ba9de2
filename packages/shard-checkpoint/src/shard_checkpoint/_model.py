"""Model state dicts of sharded models: sharded (DTensor shards), full (plain tensors) or local.

Keys are the unwrapped model's qualified names, whoever sharded it:
``fully_shard`` changes a module's class, never its structure, and its
parameters are DTensors already; ``FullyShardedDataParallel`` units hold
flat shards, turned into per-parameter values one unit at a time
(``_flat.py``). A model may mix both front ends (``fully_shard`` over
wrapped blocks). A sharded state dict holds each parameter as a ``Shard(0)``
DTensor cut like ``torch.chunk``; a full one gathers each value on its own,
so a rank holds at most one unit's (or one tensor's) gathered values beyond
what it keeps; with ``cpu_offload`` only rank 0 keeps them. A local one
(the wrapper's ``LOCAL_STATE_DICT``) holds each wrapper unit's flat shard as
it is, under ``<wrapper>._flat_param``, and buffers in the dtype the model
holds them in (as PyTorch's does: mixed precision's ``buffer_dtype`` shows).

[Note: loading one tensor at a time]
Loading never builds the full model on a rank that does not already have it.
A full value that every rank holds is cut into this rank's rows as a view (no
copy) and copied into the parameter's shard; a wrapper unit's shard is
written from its parameters' full values, one unit at a time, without
communication. With ``broadcast_from_rank0`` rank 0 first broadcasts the list
of keys, shapes and dtypes; then, key after key (unit after unit for the
wrapper), each rank receives the full tensors, copies its rows into its
shards and drops them before the next: one unit or tensor beyond the shards.

[Note: loading into the meta device]
A tensor the model still holds on the meta device (a module the wrapper
ignores, so that its ``param_init_fn`` never materialised it; a model
loaded into before ``to_empty``) has no storage to copy into, so copying
would silently keep nothing. Such a full value is given its own storage on
the device the model's other tensors use (the CPU when there is none) and
assigned into the module instead, as PyTorch's ``set_model_state_dict``
does (``assign=True``); the parameter keeps its ``requires_grad``, and
slots that shared the meta tensor (tied weights) share the new one.

[Note: what the functional API adds]
``get_model_state_dict`` and ``set_model_state_dict`` (and
``get_state_dict``/``set_state_dict``, which call the same two helpers) add
PyTorch's user-facing rules on top of the state dicts built here, so that
code written against ``torch.distributed.checkpoint.state_dict`` behaves the
same: options are checked when used (they are mutable); ``ignore_frozen_params``
and the deprecated ``submodules`` filter the keys after the state dict is
built (so every rank still takes part in every gather); an empty state dict
is refused under ``strict`` unless an option explains it (rank-0-only
offload, broadcast, a filter); an empty one loads nothing otherwise.
"""

from __future__ import annotations

import enum
import functools
import warnings
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.distributed.tensor import DTensor, Replicate, Shard

from shard_checkpoint._dist import broadcast_object, broadcast_tensor, rank
from shard_checkpoint._errors import StateDictError
from shard_checkpoint._flat import (
    FLAT_PARAM,
    flat_key,
    gather_full,
    gathered_copies,
    local_flat,
    write_shard,
)
from shard_checkpoint._options import (
    StateDictOptions,
    checked_options,
    warn_submodules_deprecated,
)
from shard_checkpoint._tensors import full_value, local_chunk, same_layout, shard_like, to_cpu
from shard_core import dim0_chunk_range
from shard_runtime import FSDPModule
from shard_runtime.plumbing import (
    FlatUnit,
    clean_fqn,
    contiguous_dtensor,
    flat_units,
    meta_tie_groups,
    original_buffer_dtypes,
    raw_module_state_dicts,
    retie,
)

__all__ = [
    "IncompatibleKeys",
    "Kind",
    "TensorSpec",
    "check_not_empty",
    "frozen_keys",
    "functional_model_state_dict",
    "get_model_state_dict",
    "in_module_order",
    "keyed_by_name",
    "load_functional_model_state_dict",
    "load_model_state_dict",
    "model_state_dict",
    "plain_entries",
    "reshard_model",
    "set_model_state_dict",
    "state_dict_name",
    "submodule_prefixes",
]


class Kind(enum.Enum):
    """The form of a model state dict (``StateDictType`` without the runtime import)."""

    # Plain full tensors.
    FULL = enum.auto()
    # ``Shard(0)`` DTensors per parameter.
    SHARDED = enum.auto()
    # Wrapper units as their flat shards (``<wrapper>._flat_param``); the rest as SHARDED, but
    # buffers as the model holds them.
    LOCAL = enum.auto()


class IncompatibleKeys(NamedTuple):
    """What ``set_model_state_dict`` (``strict=False``) could not match."""

    missing_keys: list[str]
    """Keys the model has and the state dict lacks (left untouched)."""
    unexpected_keys: list[str]
    """Keys the state dict has and the model lacks (ignored)."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor's shape and dtype, sent ahead of its data in a broadcast."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device_type: str


def reshard_model(model: nn.Module) -> None:
    """Register every unit's sharded parameters (a unit kept unsharded after forward is freed)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    for unit in flat_units(model):
        unit.ensure_sharded()


def get_model_state_dict(
    model: nn.Module,
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """The model's state dict, keyed by the unwrapped model's qualified names.

    Args:
        model: a model sharded by ``fully_shard`` (any part of it), by
            ``FullyShardedDataParallel`` (either ``use_orig_params``), by both,
            or a plain model.
        submodules: deprecated (a ``FutureWarning``, as in PyTorch): keep only
            the keys under these submodules (see ``keep_submodule_prefixes``).
        options: ``full_state_dict`` gathers sharded values into plain tensors
            (a collective: call it on every rank); ``cpu_offload`` moves values
            to the CPU and, with ``full_state_dict``, leaves every rank but 0
            with ``{}``; ``ignore_frozen_params`` leaves out parameters with
            ``requires_grad=False``.

    Returns:
        ``{fqn: value}``: ``Shard(0)`` DTensors for sharded parameters, plain
        tensors otherwise (buffers, unsharded parameters, every value when
        full). Buffers a wrapper's mixed precision cast come back in their
        original dtype.

    Raises:
        StateDictError: the state dict is empty under ``strict`` (a model
            without parameters or buffers), as PyTorch refuses it.
        ValueError: ``broadcast_from_rank0`` without ``full_state_dict``.
    """
    warn_submodules_deprecated(submodules, "get_model_state_dict", stacklevel=2)
    options = checked_options(options, "get_model_state_dict")
    return functional_model_state_dict(model, options, submodules, "get_model_state_dict")


def set_model_state_dict(
    model: nn.Module,
    model_state_dict: Mapping[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> IncompatibleKeys:
    """Load ``model_state_dict`` (sharded or full) into ``model``'s shards.

    Values may be DTensors (copied shard to shard when laid out like the
    parameter, resharded otherwise) or full tensors (this rank keeps its
    rows). See [Note: loading one tensor at a time].

    Args:
        model: the model to load into (sharded by either front end, both, or plain).
        model_state_dict: ``{fqn: value}``. With ``broadcast_from_rank0`` only
            rank 0's is read; other ranks may pass ``{}``. An empty one loads
            nothing (refused under ``strict``, as PyTorch does). Keys may also
            be submodules of ``model`` mapping to their own state dicts
            (deprecated in PyTorch: a ``FutureWarning``).
        options: ``strict`` (default) makes a missing or unexpected key an
            error naming it, before anything is loaded; ``broadcast_from_rank0``
            as described above.

    Returns:
        The missing and unexpected keys (both empty under ``strict``).

    Raises:
        StateDictError: a missing or unexpected key under ``strict``, an
            empty state dict under ``strict``, or a value whose shape differs
            from the model's. A ``RuntimeError``, as PyTorch raises.
        ValueError: ``broadcast_from_rank0`` without ``full_state_dict``.
    """
    model_state_dict = keyed_by_name(model, model_state_dict, "set_model_state_dict", stacklevel=2)
    options = checked_options(options, "set_model_state_dict")
    return load_functional_model_state_dict(
        model, model_state_dict, options, "set_model_state_dict"
    )


# ------------------------------------------------------------------ the functional API
# See [Note: what the functional API adds]


def functional_model_state_dict(
    model: nn.Module,
    options: StateDictOptions,
    submodules: Collection[nn.Module] | None,
    caller: str,
) -> dict[str, Any]:
    """What :func:`get_model_state_dict` returns, arguments checked; ``get_state_dict`` too."""
    state = model_state_dict(
        model,
        Kind.FULL if options.full_state_dict else Kind.SHARDED,
        offload_to_cpu=options.cpu_offload,
        rank0_only=options.cpu_offload,
    )
    if options.ignore_frozen_params:
        for key in frozen_keys(model, options.dsd_fqn_modifiers):
            state.pop(key, None)
    prefixes = submodule_prefixes(model, submodules)
    if prefixes:
        kept: dict[str, Any] = {}
        for key, value in state.items():
            for prefix in prefixes:
                if key.startswith(prefix):
                    kept[key if options.keep_submodule_prefixes else key[len(prefix) :]] = value
        state = kept
    empty_allowed = bool(prefixes) or options.ignore_frozen_params
    check_not_empty(state, options, caller, "model", empty_allowed=empty_allowed)
    return state


def load_functional_model_state_dict(
    model: nn.Module,
    model_state_dict: Mapping[str, Any],
    options: StateDictOptions,
    caller: str,
) -> IncompatibleKeys:
    """What :func:`set_model_state_dict` does, arguments checked; ``set_state_dict`` too."""
    check_not_empty(
        model_state_dict, options, caller, "model", empty_allowed=options.ignore_frozen_params
    )
    if not model_state_dict and not options.broadcast_from_rank0:
        return IncompatibleKeys(missing_keys=[], unexpected_keys=[])
    return load_model_state_dict(
        model,
        model_state_dict,
        Kind.FULL if options.full_state_dict else Kind.SHARDED,
        strict=options.strict,
        broadcast_from_rank0=options.broadcast_from_rank0,
        caller=Caller(caller, "pass options=StateDictOptions(strict=False)"),
    )


def check_not_empty(
    state: Mapping[Any, Any],
    options: StateDictOptions,
    caller: str,
    what: str,
    *,
    empty_allowed: bool,
    only_if_strict: bool = True,
) -> None:
    """Refuse an empty state dict where PyTorch does: no option explains it.

    Ranks other than 0 legitimately hold ``{}`` with ``full_state_dict`` and
    ``cpu_offload`` (and when loading with ``broadcast_from_rank0``). PyTorch
    accepts an empty model state dict under ``strict=False`` but never an
    empty optimizer state dict (``only_if_strict=False``).
    """
    if (
        state
        or empty_allowed
        or (only_if_strict and not options.strict)
        or options.broadcast_from_rank0
        or (options.full_state_dict and options.cpu_offload)
    ):
        return
    raise StateDictError(
        f"{caller}: the {what} state dict is empty on rank {rank()} (nothing to save, or "
        f"an empty dict passed in), which PyTorch refuses as well; pass a non-empty {what} "
        "state dict"
        + (", or options=StateDictOptions(strict=False) to accept it" if only_if_strict else "")
    )


def submodule_prefixes(model: nn.Module, submodules: Collection[nn.Module] | None) -> list[str]:
    """``"<name>."`` for each of ``submodules`` in ``model`` (PyTorch's deprecated filter).

    The root's name is empty, so passing ``model`` itself keeps nothing, as in PyTorch.
    """
    if not submodules:
        return []
    wanted = {id(module) for module in submodules}
    prefixes: list[str] = []
    for name, module in model.named_modules():
        prefix = clean_fqn(name) + "."
        if id(module) in wanted and prefix not in prefixes:
            prefixes.append(prefix)
    return prefixes


def keyed_by_name(
    model: nn.Module, model_state_dict: Mapping[Any, Any], caller: str, *, stacklevel: int
) -> Mapping[str, Any]:
    """``model_state_dict`` with submodule keys (``{submodule: its state dict}``) spelled out.

    PyTorch still accepts that form and warns (``FutureWarning``) that it is
    deprecated; so do we, pointing at the caller's line (``stacklevel``
    counts from the caller of this function).
    """
    if not model_state_dict or not isinstance(next(iter(model_state_dict)), nn.Module):
        return model_state_dict
    warnings.warn(
        f"{caller}: a model state dict keyed by submodules ({{submodule: its state dict}}) is "
        "deprecated (as in PyTorch, which plans to remove it); key it by qualified name "
        "('<submodule>.<key>') instead",
        FutureWarning,
        stacklevel=stacklevel + 1,
    )
    names = {id(module): clean_fqn(name) for name, module in model.named_modules()}
    spelled: dict[str, Any] = {}
    for submodule, sub_state in model_state_dict.items():
        name = names.get(id(submodule))
        if name is None:
            raise StateDictError(
                f"{caller}: the model state dict is keyed by a {type(submodule).__name__} that "
                "is not a submodule of the model; key it by qualified names, or by the "
                "model's own submodules"
            )
        spelled.update({f"{name}.{key}" if name else key: v for key, v in sub_state.items()})
    return spelled


def frozen_keys(model: nn.Module, fqn_modifiers: str) -> set[str]:
    """The keys of parameters with ``requires_grad=False`` (``ignore_frozen_params``).

    A wrapper unit with ``use_orig_params=False`` has one flat parameter: its
    parameters are frozen together or not at all. With ``use_orig_params=True``
    each original parameter says for itself.
    """
    frozen: set[str] = set()
    for unit in flat_units(model):
        for info in unit.params:
            holder = unit.flat_param if unit.flat_param is not None else info.param
            if holder is not None and not holder.requires_grad:
                frozen.update(info.keys)
    for name, param in model.named_parameters(remove_duplicate=False):
        if not param.requires_grad:
            frozen.add(state_dict_name(model, name, fqn_modifiers))
    return frozen


def state_dict_name(model: nn.Module, name: str, fqn_modifiers: str) -> str:
    """Parameter ``name`` as ``model.state_dict()`` spells it.

    A module whose state-dict hooks save a child's tensors under its own
    prefix declares it with the method named ``fqn_modifiers`` (see
    ``StateDictOptions.dsd_fqn_modifiers``): that child's name is left out.
    So is the wrapped module of an activation-checkpointing wrapper
    (``checkpoint_wrapper``), whose state-dict hooks do the same.
    """
    kept: list[str] = []
    module: Any = model
    for part in name.split("."):
        renames = getattr(module, fqn_modifiers, None) if isinstance(module, nn.Module) else None
        hidden = isinstance(module, ActivationWrapper) and getattr(module, part, None) is getattr(
            module, "_checkpoint_wrapped_module", None
        )
        if not (hidden or (callable(renames) and part in renames().values())):
            kept.append(part)
        module = getattr(module, part, None)
    return clean_fqn(".".join(kept))


# ------------------------------------------------------------------ building


def model_state_dict(
    model: nn.Module,
    kind: Kind,
    *,
    offload_to_cpu: bool,
    rank0_only: bool,
) -> dict[str, Any]:
    """``model``'s state dict of ``kind`` (a collective for FULL and SHARDED wrapper units).

    ``rank0_only`` (FULL only) leaves every rank but 0 with ``{}``.
    """
    reshard_model(model)
    units = flat_units(model)
    names = _module_names(model)
    keep = kind is not Kind.FULL or not rank0_only or rank() == 0
    out: dict[str, Any] = {}
    params: set[str] = set()
    for unit in units:  # See [Note: one unit at a time] in _flat.py
        if kind is Kind.LOCAL:
            out[flat_key(unit, names)] = _local_dtensor(unit, offload_to_cpu)
            continue
        params.update(key for param in unit.params for key in param.keys)
        values = gathered_copies(
            unit,
            unit.shard,
            label=f"state_dict ({unit.params[0].keys[0]})",
            full=kind is Kind.FULL,
            offload_to_cpu=offload_to_cpu,
            wanted=range(len(unit.params)) if keep else (),
        )
        for index, value in values.items():
            out.update(dict.fromkeys(unit.params[index].keys, value))
    dtypes = original_buffer_dtypes(model)
    for key, value in plain_entries(model, units, keep_vars=False).items():
        if isinstance(value, torch.Tensor) and kind is Kind.FULL:
            value = full_value(value)  # every rank takes part, kept or not
        if not keep:
            continue
        if isinstance(value, torch.Tensor):
            if key in dtypes and kind is not Kind.LOCAL:
                value = value.to(dtypes[key])
            if offload_to_cpu:
                value = to_cpu(value)
        out[key] = value
    params.update(clean_fqn(n) for n, _ in model.named_parameters(remove_duplicate=False))
    return in_module_order(model, out, params)


def _local_dtensor(unit: FlatUnit, offload_to_cpu: bool) -> DTensor:
    """The unit's flat shard as a ``Shard(0)`` DTensor of the flat buffer, the layout of PyTorch's
    ``LOCAL_STATE_DICT`` (a ShardedTensor there).

    The padding that evens out the shards sits at the end of the flat buffer,
    so leaving it out of each rank's shard gives ``torch.chunk``'s pieces of
    the unpadded buffer. With ``use_orig_params=True`` PyTorch counts that
    padding as part of its flat parameter (it pads for alignment there), so
    the shards are kept whole.
    """
    total = unit.world * unit.shard_numel if unit.use_orig_params else unit.layout.total_numel
    local = unit.shard.detach()[: len(dim0_chunk_range(total, unit.rank, unit.world))]
    if offload_to_cpu:
        local = local.cpu()
    mesh = unit.mesh
    return contiguous_dtensor(local, mesh, [Replicate()] * (mesh.ndim - 1) + [Shard(0)], [total])


def plain_entries(model: nn.Module, units: list[FlatUnit], *, keep_vars: bool) -> dict[str, Any]:
    """``nn.Module.state_dict`` under clean keys, without what wrapper units hold."""
    owned = {key for unit in units for param in unit.params for key in param.keys}
    entries: dict[str, Any] = {}
    with raw_module_state_dicts():  # See [Note: raw module state dicts] in shard_runtime
        raw = nn.Module.state_dict(model, keep_vars=keep_vars)
    for key, value in raw.items():
        clean = clean_fqn(key)
        if clean in owned or clean == FLAT_PARAM or clean.endswith("." + FLAT_PARAM):
            continue
        entries[clean] = value
    return entries


def _module_names(model: nn.Module) -> dict[int, str]:
    return {id(m): clean_fqn(n) for n, m in model.named_modules(remove_duplicate=False)}


def in_module_order(model: nn.Module, state: dict[str, Any], params: set[str]) -> dict[str, Any]:
    """``state`` in the plain model's order: module by module, parameters before the rest."""
    order: dict[str, int] = {}
    for name, _ in model.named_modules(remove_duplicate=False):
        order.setdefault(clean_fqn(name), len(order))

    def rank_of(key: str) -> tuple[int, int]:
        return order.get(key.rpartition(".")[0], len(order)), 0 if key in params else 1

    return {key: state[key] for key in sorted(state, key=rank_of)}


# ------------------------------------------------------------------ loading


@dataclass(frozen=True, slots=True)
class Caller:
    """Who loads, for error messages: the API's name and how to relax ``strict``."""

    name: str
    relax: str


def load_model_state_dict(
    model: nn.Module,
    state_dict: Mapping[str, Any],
    kind: Kind,
    *,
    strict: bool,
    broadcast_from_rank0: bool,
    caller: Caller,
) -> IncompatibleKeys:
    """Load ``state_dict`` into ``model``; see :func:`set_model_state_dict`."""
    if broadcast_from_rank0 and kind is Kind.LOCAL:
        raise ValueError(f"{caller.name}: broadcast_from_rank0 loads full state dicts, not LOCAL")
    reshard_model(model)
    units = flat_units(model)
    names = _module_names(model)
    targets = plain_entries(model, units, keep_vars=True)
    unit_keys = [
        [flat_key(unit, names)]
        if kind is Kind.LOCAL
        else [key for param in unit.params for key in param.keys]
        for unit in units
    ]
    owned = [key for keys in unit_keys for key in keys]
    params = {*owned, *(clean_fqn(n) for n, _ in model.named_parameters(remove_duplicate=False))}
    expected = list(in_module_order(model, dict.fromkeys([*owned, *targets]), params))
    if broadcast_from_rank0:
        manifest = _manifest_from_rank0(state_dict)
        given = list(manifest)
    else:
        manifest = {}
        given = list(state_dict)
    missing, unexpected = _check_keys(expected, given, strict, caller)
    fetch = _Fetch(state_dict, manifest if broadcast_from_rank0 else None)
    for unit, keys in zip(units, unit_keys, strict=True):
        label = f"{caller.name} ({keys[0]})"
        if kind is Kind.LOCAL:
            value = state_dict.get(keys[0])  # as it is: local_flat reads DTensors itself
            if isinstance(value, torch.Tensor):
                unit.ensure_sharded()
                with torch.no_grad():
                    unit.shard.copy_(local_flat(unit, value, key=keys[0]))
            continue
        fulls = [fetch.first(param.keys, unit.compute_device) for param in unit.params]
        if any(v is not None for v in fulls):
            write_shard(
                unit,
                fulls,
                current=functools.partial(_current, unit, label),
                label=caller.name,
            )
        del fulls
    device = _storage_device(units, targets)
    if broadcast_from_rank0:
        received = _receive_from_rank0(targets, manifest, state_dict, caller, device)
        prepared = {k: v for k, v in received.items() if v is not None}
    else:
        prepared = {
            key: _prepare(key, targets[key], state_dict[key], caller)
            for key in targets
            if key in state_dict
        }
    # See [Note: loading into the meta device].
    on_meta = {
        key: value
        for key, value in prepared.items()
        if isinstance(value, torch.Tensor) and _on_meta(targets.get(key))
    }
    for key in on_meta:
        del prepared[key]
    if not broadcast_from_rank0:  # the caller's tensors: the model must not share them
        on_meta = {key: value.detach().to(device, copy=True) for key, value in on_meta.items()}
    with torch.no_grad(), raw_module_state_dicts():
        nn.Module.load_state_dict(model, prepared, strict=False)
        if on_meta:
            _assign_keeping_ties(model, on_meta)
    return IncompatibleKeys(missing_keys=missing, unexpected_keys=unexpected)


def _on_meta(target: Any) -> bool:
    return isinstance(target, torch.Tensor) and not isinstance(target, DTensor) and target.is_meta


def _storage_device(units: list[FlatUnit], targets: Mapping[str, Any]) -> torch.device:
    """Where a value loaded into a meta tensor gets its storage: see [Note: loading into the
    meta device]."""
    if units:
        return units[0].compute_device
    for target in targets.values():
        if isinstance(target, DTensor):
            return target.to_local().device
        if isinstance(target, torch.Tensor) and not target.is_meta:
            return target.device
    return torch.device("cpu")


def _assign_keeping_ties(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Assign ``values`` into the model's meta tensors; slots that shared one share its value."""
    ties = meta_tie_groups(model.modules())
    nn.Module.load_state_dict(model, values, strict=False, assign=True)
    retie(ties)


def _current(unit: FlatUnit, label: str) -> list[torch.Tensor]:
    return gather_full(unit, unit.shard, label=label)


class _Fetch:
    """Full values for keys: from the local state dict, or broadcast from rank 0 in call order."""

    def __init__(self, state_dict: Mapping[str, Any], manifest: Mapping[str, Any] | None) -> None:
        self.state_dict = state_dict
        self.manifest = manifest

    def __call__(self, key: str, device: torch.device) -> torch.Tensor | None:
        if self.manifest is None:
            value = self.state_dict.get(key)
            return full_value(value) if isinstance(value, torch.Tensor) else None
        spec = self.manifest.get(key)
        if not isinstance(spec, TensorSpec):
            return None
        if rank() == 0:
            buffer = self.state_dict[key].detach().to(device).contiguous()
        else:
            buffer = torch.empty(spec.shape, dtype=spec.dtype, device=device)
        return broadcast_tensor(buffer, label=f"state_dict ({key})")

    def first(self, keys: tuple[str, ...], device: torch.device) -> torch.Tensor | None:
        """The value of the first of ``keys`` present (tied parameters have several)."""
        given = self.manifest if self.manifest is not None else self.state_dict
        for key in keys:
            if key in given:
                return self(key, device)
        return None


# ------------------------------------------------------------------ helpers


def _check_keys(
    expected: list[str], given: list[str], strict: bool, caller: Caller
) -> tuple[list[str], list[str]]:
    """The missing and unexpected keys; under ``strict``, an error naming the first one."""
    known = set(given)
    missing = [k for k in expected if k not in known]
    wanted = set(expected)
    unexpected = [k for k in given if k not in wanted]
    if strict and missing:
        raise StateDictError(
            f"{caller.name}: the state dict has no value for {missing[0]!r} "
            f"({len(missing)} of the model's {len(expected)} keys are missing); load a "
            f"state dict of this model, or {caller.relax} to load the keys it has"
        )
    if strict and unexpected:
        raise StateDictError(
            f"{caller.name}: the state dict has a value for {unexpected[0]!r}, "
            f"which the model does not have ({len(unexpected)} such keys); load a state "
            f"dict of this model, or {caller.relax} to ignore them"
        )
    return missing, unexpected


def _check_shape(key: str, target: torch.Tensor, shape: tuple[int, ...], caller: Caller) -> None:
    if tuple(target.shape) != shape:
        raise StateDictError(
            f"{caller.name}: {key!r} has shape {shape} in the state dict but "
            f"{tuple(target.shape)} in the model; load a state dict of this model"
        )


def _prepare(key: str, target: Any, value: Any, caller: Caller) -> Any:
    """``value`` in the form ``load_state_dict`` copies into ``target`` locally."""
    if not isinstance(target, torch.Tensor) or not isinstance(value, torch.Tensor):
        return value
    _check_shape(key, target, tuple(value.shape), caller)
    if isinstance(target, DTensor):
        if isinstance(value, DTensor) and same_layout(value, target):
            return value
        return shard_like(full_value(value), target, key=key)
    return full_value(value)


def _manifest_from_rank0(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Rank 0's keys with the shape and dtype of each tensor (other values as they are)."""
    manifest: dict[str, Any] | None = None
    if rank() == 0:
        manifest = {}
        for key, value in state_dict.items():
            if isinstance(value, DTensor):
                manifest[key] = StateDictError(
                    f"set_model_state_dict: broadcast_from_rank0 expects full tensors on rank "
                    f"0, but {key!r} is a DTensor; pass a full state dict "
                    "(get_model_state_dict with full_state_dict=True), or load sharded "
                    "state dicts without broadcast_from_rank0"
                )
            elif isinstance(value, torch.Tensor):
                manifest[key] = TensorSpec(tuple(value.shape), value.dtype, value.device.type)
            else:
                manifest[key] = value
    manifest = broadcast_object(manifest)
    assert manifest is not None
    for spec in manifest.values():
        if isinstance(spec, StateDictError):
            raise spec
    return manifest


def _receive_from_rank0(
    targets: Mapping[str, Any],
    manifest: Mapping[str, Any],
    state_dict: Mapping[str, Any],
    caller: Caller,
    device: torch.device,
) -> dict[str, Any]:
    """Rank 0's values, broadcast key by key; see [Note: loading one tensor at a time].

    Tensors are copied straight into the model's shards and buffers as they
    arrive (the keys map to ``None``); other values, and the tensors for
    targets still on the meta device (received on ``device``: see [Note:
    loading into the meta device]), are returned for ``load_state_dict``.
    """
    for key, spec in manifest.items():
        target = targets.get(key)
        if isinstance(spec, TensorSpec) and isinstance(target, torch.Tensor):
            _check_shape(key, target, spec.shape, caller)
    received: dict[str, Any] = {}
    for key, target in targets.items():
        if key not in manifest:
            continue
        spec = manifest[key]
        if not isinstance(spec, TensorSpec) or not isinstance(target, torch.Tensor):
            received[key] = spec
            continue
        with torch.no_grad():
            local = target.to_local() if isinstance(target, DTensor) else target
            into = device if _on_meta(target) else local.device
            if rank() == 0:
                buffer = state_dict[key].detach().to(into).contiguous()
            else:
                buffer = torch.empty(spec.shape, dtype=spec.dtype, device=into)
            broadcast_tensor(buffer, label=f"state_dict ({key})")
            if _on_meta(target):
                received[key] = buffer
                continue
            if isinstance(target, DTensor):
                local.copy_(local_chunk(buffer, target, key=key))
            else:
                local.copy_(buffer)
        del buffer
        received[key] = None
    return received
