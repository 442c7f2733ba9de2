"""Optimizer state dicts rekeyed between parameter names and positions (the wrapper's API).

``FullyShardedDataParallel.rekey_optim_state_dict`` (PyTorch's
``OptimStateKeyType``) turns a name-keyed state dict into the positional
one a plain ``torch.optim`` optimizer over the unwrapped model loads, and
back. Only keys change: values are left as they are, and nothing is
communicated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shard_checkpoint._errors import StateDictError
from shard_checkpoint._model import in_module_order
from shard_checkpoint._optim_entries import GROUPS, PARAMS, STATE, all_entries, optimizer_entries
from shard_runtime.plumbing import clean_fqn, flat_units

__all__ = ["rekey_optimizer_state_dict"]


def rekey_optimizer_state_dict(
    optim_state_dict: Mapping[str, Any],
    key_type: str,
    model: nn.Module,
    optim: torch.optim.Optimizer | None,
) -> dict[str, Any]:
    """``optim_state_dict`` keyed by name (``"PARAM_NAME"``) or by position (``"PARAM_ID"``).

    Positions count the parameters of ``optim`` in its param groups' order
    (one position per original parameter, even when a wrapper unit's flat
    shard holds several), or ``model``'s parameters in module order when
    ``optim`` is ``None``: what a plain optimizer over the unwrapped model
    numbers them. No communication.
    """
    if key_type not in ("PARAM_NAME", "PARAM_ID"):
        raise ValueError(f"key type must be PARAM_NAME or PARAM_ID, got {key_type!r}")
    if optim is not None:
        order = [
            fqn for entry in all_entries(optimizer_entries(model, [optim])) for fqn in entry.fqns
        ]
    else:
        order = _model_param_order(model)
    if key_type == "PARAM_ID":
        position = {fqn: i for i, fqn in enumerate(order)}

        def rekey(key: Any) -> Any:
            if isinstance(key, int):
                return key
            if key not in position:
                raise StateDictError(
                    f"rekey_optim_state_dict: {key!r} is not a parameter of the model; "
                    "rekey a state dict of this model"
                )
            return position[key]

    else:

        def rekey(key: Any) -> Any:
            if isinstance(key, str):
                return key
            if not 0 <= key < len(order):
                raise StateDictError(
                    f"rekey_optim_state_dict: parameter id {key} is out of range: the model "
                    f"has {len(order)} parameters; rekey a state dict of this model"
                )
            return order[key]

    # ``Optimizer.load_state_dict`` pairs parameters by their order in the groups:
    # positions go in ascending order, as a plain optimizer lists them. Names are
    # sorted too, as PyTorch lists them (loading matches names, not places). The
    # state keeps the order it came in, as PyTorch's does.
    groups = []
    for group in optim_state_dict[GROUPS]:
        groups.append({**group, PARAMS: sorted(rekey(k) for k in group[PARAMS])})
    state = {rekey(k): v for k, v in optim_state_dict[STATE].items()}
    return {STATE: state, GROUPS: groups}


def _model_param_order(model: nn.Module) -> list[str]:
    """The unwrapped model's parameter names in module order (flat shards expanded)."""
    units = {id(unit.flat_param): unit for unit in flat_units(model) if unit.flat_param is not None}
    names: list[str] = []
    for name, param in model.named_parameters():
        unit = units.get(id(param))
        if unit is None:
            names.append(clean_fqn(name))
        else:
            names.extend(p.keys[0] for p in unit.params)
    return list(in_module_order(model, dict.fromkeys(names), set(names)))
