"""The value types of state dicts, under the names ``torch.distributed.checkpoint.state_dict`` uses.

Code written against PyTorch annotates with these names (``ValueType``,
``OptimizerStateType``...); exporting the same names with the same meaning
keeps such annotations valid after the import line changes. PyTorch also
lists its legacy ``ShardedTensor``; that class derives from ``torch.Tensor``,
so ``torch.Tensor`` here admits it without importing a private module.
"""

from __future__ import annotations

from typing import TypeAlias

import torch
from torch.distributed.tensor import DTensor

__all__ = [
    "DictValueType",
    "FQNS_T",
    "ListDictValueType",
    "OptimizerStateType",
    "PrimitiveType",
    "ValueType",
]

FQNS_T: TypeAlias = set[str]
"""The qualified names one state-dict entry stands for (tied parameters have several)."""

PrimitiveType: TypeAlias = DTensor | torch.Tensor | int | float | str
"""A leaf value: a tensor (sharded or not) or a scalar."""

ValueType: TypeAlias = (
    PrimitiveType | list[PrimitiveType] | tuple[PrimitiveType] | dict[str, "ValueType"]
)
"""A value of a model state dict: a leaf, a list or tuple of leaves, or a nested dict."""

DictValueType: TypeAlias = dict[str, ValueType]
"""A model state dict, or one parameter's optimizer state."""

ListDictValueType: TypeAlias = list[DictValueType]
"""An optimizer's ``param_groups``."""

OptimizerStateType: TypeAlias = dict[str, DictValueType | ListDictValueType]
"""An optimizer state dict: ``{"state": {fqn: {...}}, "param_groups": [...]}`` or the flat form."""
