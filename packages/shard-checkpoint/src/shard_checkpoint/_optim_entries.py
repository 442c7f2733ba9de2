"""Which parameter each optimizer slot is, and the qualified names its state goes under.

Both directions of the optimizer state dict (``_optim.py``), the wrapper
units' flat state (``_optim_flat_units.py``) and rekeying
(``_optim_rekey.py``) start from this layout: per optimizer, per param
group, one :class:`Entry` per parameter the group holds. A plain or
``fully_shard`` parameter has one name; a ``FullyShardedDataParallel``
unit's flat shard has the names of every parameter in it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shard_checkpoint._errors import StateDictError
from shard_runtime.plumbing import FlatUnit, clean_fqn, flat_units

__all__ = [
    "GROUPS",
    "PARAMS",
    "STATE",
    "Entry",
    "GroupOptions",
    "States",
    "all_entries",
    "held_units",
    "optimizer_entries",
    "param_group_options",
]

STATE = "state"
GROUPS = "param_groups"
PARAMS = "params"

# Per fqn: {state name: value}, and per fqn: its param group's options.
States = dict[str, dict[str, Any]]
GroupOptions = dict[str, dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Entry:
    """One parameter an optimizer holds and the names its state goes under.

    ``unit`` is set for wrapper parameters: the unit's flat shard (``index``
    ``None``, ``fqns`` every parameter of the unit) or one original
    parameter's piece of it (``index`` its position in the unit).
    """

    param: torch.Tensor
    fqns: list[str]
    unit: FlatUnit | None = None
    index: int | None = None


def optimizer_entries(
    model: nn.Module, optims: list[torch.optim.Optimizer]
) -> list[list[list[Entry]]]:
    """Per optimizer, per param group, what each parameter is and the names it holds."""
    owned: dict[int, tuple[FlatUnit, int | None]] = {}
    for unit in flat_units(model):
        if unit.flat_param is not None:
            owned[id(unit.flat_param)] = (unit, None)
        else:
            for index, info in enumerate(unit.params):
                assert info.param is not None
                owned[id(info.param)] = (unit, index)
    names = _param_names(model)
    layout: list[list[list[Entry]]] = []
    for o, optim in enumerate(optims):
        groups: list[list[Entry]] = []
        for g, group in enumerate(optim.param_groups):
            entries: list[Entry] = []
            for i, param in enumerate(group[PARAMS]):
                found = owned.get(id(param))
                if found is None:
                    entries.append(Entry(param, [_fqn(names, param, o, g, i)]))
                    continue
                holder, position = found
                if position is None:
                    entries.append(Entry(param, [p.keys[0] for p in holder.params], holder))
                else:
                    entries.append(
                        Entry(param, [holder.params[position].keys[0]], holder, position)
                    )
            groups.append(entries)
        layout.append(groups)
    return layout


def all_entries(layout: list[list[list[Entry]]]) -> list[Entry]:
    """Every entry of :func:`optimizer_entries`'s layout, optimizers and groups in order."""
    return [entry for groups in layout for entries in groups for entry in entries]


def held_units(layout: list[list[list[Entry]]]) -> list[FlatUnit]:
    """The wrapper units the optimizers hold parameters of, in first-held order."""
    units: dict[int, FlatUnit] = {}
    for groups in layout:
        for entries in groups:
            for entry in entries:
                if entry.unit is not None:
                    units.setdefault(id(entry.unit.wrapper), entry.unit)
    return list(units.values())


def _param_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), clean_fqn(name))
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


def param_group_options(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's options (``lr``, ``betas``, ...): everything but its ``params``."""
    return {k: v for k, v in group.items() if k != PARAMS}
