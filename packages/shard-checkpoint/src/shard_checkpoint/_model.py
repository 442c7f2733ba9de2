"""Model state dicts of sharded models: sharded (DTensor shards) or full (plain tensors).

Keys are the model's own qualified names (``fully_shard`` changes a module's
class, never its structure). A sharded state dict is what
``model.state_dict()`` holds between steps, the parameters' DTensor shards,
with no communication. A full one gathers each sharded value on its own,
``full_tensor()`` one parameter after another, so a rank holds at most one
gathered tensor beyond what it keeps; with ``cpu_offload`` only rank 0 keeps
them.

[Note: loading one tensor at a time]
``set_model_state_dict`` never builds the full model on a rank that does not
already have it. A full value that every rank holds is cut into this rank's
rows as a view (no copy) and copied into the parameter's shard by
``model.load_state_dict`` (which keeps module hooks, extra state and
``strict`` semantics). With ``broadcast_from_rank0`` rank 0 first broadcasts
the list of keys, shapes and dtypes; then, key after key, each rank receives
one full tensor, copies its rows straight into the parameter's shard and
drops it before the next broadcast: one full tensor beyond the shards.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shard_checkpoint._dist import broadcast_object, broadcast_tensor, rank
from shard_checkpoint._errors import StateDictError
from shard_checkpoint._options import StateDictOptions
from shard_checkpoint._tensors import full_value, local_chunk, same_layout, shard_like, to_cpu
from shard_checkpoint._wrapper_backend import WrapperStateDictBackend, is_wrapper_model
from shard_runtime import FSDPModule

__all__ = [
    "IncompatibleKeys",
    "get_model_state_dict",
    "reshard_model",
    "set_model_state_dict",
]


_WRAPPER = WrapperStateDictBackend()
"""The state dicts of ``FullyShardedDataParallel`` models (the outermost wrapper)."""


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


def get_model_state_dict(
    model: nn.Module, *, options: StateDictOptions | None = None
) -> dict[str, Any]:
    """The model's state dict, keyed by qualified name.

    Args:
        model: a model sharded by ``fully_shard`` (any part of it), an outermost
            ``FullyShardedDataParallel`` (original names, same values), or a plain model.
        options: ``full_state_dict`` gathers sharded values into plain tensors
            (a collective: call it on every rank); ``cpu_offload`` moves values
            to the CPU and, with ``full_state_dict``, leaves every rank but 0
            with ``{}``.

    Returns:
        ``{fqn: value}``: DTensor shards for sharded parameters, plain tensors
        otherwise (buffers, unsharded parameters, every value when full).
    """
    options = options or StateDictOptions()
    if is_wrapper_model(model):
        return _WRAPPER.model_state_dict(
            model,
            "FULL_STATE_DICT" if options.full_state_dict else "SHARDED_STATE_DICT",
            offload_to_cpu=options.cpu_offload,
            rank0_only=options.cpu_offload,
        )
    reshard_model(model)
    state = model.state_dict()
    if not options.full_state_dict:
        if options.cpu_offload:
            return {k: to_cpu(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        return state
    keep = not options.cpu_offload or rank() == 0
    full: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            value = full_value(value)  # every rank takes part, kept or not
        if keep:
            full[key] = (
                value.cpu() if options.cpu_offload and isinstance(value, torch.Tensor) else value
            )
        del value
    return full


def set_model_state_dict(
    model: nn.Module,
    state_dict: Mapping[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> IncompatibleKeys:
    """Load ``state_dict`` (sharded or full) into ``model``'s shards.

    Values may be DTensors (copied shard to shard when laid out like the
    parameter, resharded otherwise) or full tensors (this rank keeps its
    rows). See [Note: loading one tensor at a time].

    Args:
        model: the model to load into, sharded by ``fully_shard`` or plain.
        state_dict: ``{fqn: value}``. With ``broadcast_from_rank0`` only rank
            0's is read; other ranks may pass ``{}``.
        options: ``strict`` (default) makes a missing or unexpected key an
            error naming it, before anything is loaded; ``broadcast_from_rank0``
            as described above.

    Returns:
        The missing and unexpected keys (both empty under ``strict``).

    Raises:
        StateDictError: a missing or unexpected key under ``strict``, or a
            value whose shape differs from the model's.
    """
    options = options or StateDictOptions()
    if is_wrapper_model(model):
        if options.broadcast_from_rank0:
            raise StateDictError(
                "set_model_state_dict: broadcast_from_rank0 is not supported for "
                "FullyShardedDataParallel models yet; pass the full state dict on every rank"
            )
        missing, unexpected = _WRAPPER.load_model_state_dict(
            model, state_dict, "FULL_STATE_DICT", strict=options.strict
        )
        return IncompatibleKeys(missing_keys=missing, unexpected_keys=unexpected)
    reshard_model(model)
    targets = model.state_dict(keep_vars=True)
    if options.broadcast_from_rank0:
        manifest = _manifest_from_rank0(state_dict)
        keys = _check_keys(targets, list(manifest), options.strict)
        loaded = _receive_from_rank0(targets, manifest, state_dict)
        prepared = {k: v for k, v in loaded.items() if v is not None}
    else:
        keys = _check_keys(targets, list(state_dict), options.strict)
        loaded = prepared = {
            key: _prepare(key, targets[key], state_dict[key])
            for key in targets
            if key in state_dict
        }
    with torch.no_grad():
        model.load_state_dict(prepared, strict=False)
    return IncompatibleKeys(
        missing_keys=[k for k in targets if k not in loaded],
        unexpected_keys=[k for k in keys if k not in targets],
    )


# ------------------------------------------------------------------ helpers


def _check_keys(targets: Mapping[str, Any], keys: list[str], strict: bool) -> list[str]:
    if strict:
        given = set(keys)
        missing = [k for k in targets if k not in given]
        unexpected = [k for k in keys if k not in targets]
        if missing:
            raise StateDictError(
                f"set_model_state_dict: the state dict has no value for {missing[0]!r} "
                f"({len(missing)} of the model's {len(targets)} keys are missing); load a "
                "state dict of this model, or pass options=StateDictOptions(strict=False) to "
                "load the keys it has"
            )
        if unexpected:
            raise StateDictError(
                f"set_model_state_dict: the state dict has a value for {unexpected[0]!r}, "
                f"which the model does not have ({len(unexpected)} such keys); load a state "
                "dict of this model, or pass options=StateDictOptions(strict=False) to ignore "
                "them"
            )
    return keys


def _check_shape(key: str, target: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(target.shape) != shape:
        raise StateDictError(
            f"set_model_state_dict: {key!r} has shape {shape} in the state dict but "
            f"{tuple(target.shape)} in the model; load a state dict of this model"
        )


def _prepare(key: str, target: Any, value: Any) -> Any:
    """``value`` in the form ``load_state_dict`` copies into ``target`` locally."""
    if not isinstance(target, torch.Tensor) or not isinstance(value, torch.Tensor):
        return value
    _check_shape(key, target, tuple(value.shape))
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
    targets: Mapping[str, Any], manifest: Mapping[str, Any], state_dict: Mapping[str, Any]
) -> dict[str, Any]:
    """Rank 0's values, broadcast key by key; see [Note: loading one tensor at a time].

    Tensors are copied straight into the model's shards and buffers as they
    arrive (the keys map to ``None``); other values are returned for
    ``load_state_dict``.
    """
    for key, spec in manifest.items():
        target = targets.get(key)
        if isinstance(spec, TensorSpec) and isinstance(target, torch.Tensor):
            _check_shape(key, target, spec.shape)
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
            if rank() == 0:
                buffer = state_dict[key].detach().to(local.device).contiguous()
            else:
                buffer = torch.empty(spec.shape, dtype=spec.dtype, device=local.device)
            broadcast_tensor(buffer, label=f"state_dict ({key})")
            if isinstance(target, DTensor):
                local.copy_(local_chunk(buffer, target, key=key))
            else:
                local.copy_(buffer)
        del buffer
        received[key] = None
    return received
