"""The model and its optimizers in one call: ``get_state_dict`` and ``set_state_dict``.

PyTorch's ``torch.distributed.checkpoint.state_dict`` offers these next to
the per-part functions; they are compositions of the same helpers, with
PyTorch's rules for what may be left out: ``get_state_dict`` accepts no
optimizer at all (the optimizer state dict is then ``{}``), and
``set_state_dict`` with an empty model state dict loads the optimizers only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from shard_checkpoint._errors import StateDictError
from shard_checkpoint._model import (
    IncompatibleKeys,
    functional_model_state_dict,
    keyed_by_name,
    load_functional_model_state_dict,
)
from shard_checkpoint._optim import (
    as_optimizer_list,
    functional_optimizer_state_dict,
    load_functional_optimizer_state_dict,
)
from shard_checkpoint._options import (
    StateDictOptions,
    checked_options,
    warn_submodules_deprecated,
)

__all__ = ["get_state_dict", "set_state_dict"]


def get_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's state dict and its optimizers' (merged), keyed by qualified names.

    The same as :func:`get_model_state_dict` followed by
    :func:`get_optimizer_state_dict` with the same ``options``, in one call.

    Args:
        model: a model sharded by ``fully_shard``, ``FullyShardedDataParallel``,
            both, or a plain model.
        optimizers: one optimizer, several over disjoint parameters, or none
            (an empty iterable: the optimizer state dict is ``{}``).
        submodules: deprecated (a ``FutureWarning``, as in PyTorch): filters
            the model state dict only.
        options: as for the two functions above.

    Returns:
        ``(model_state_dict, optim_state_dict)``.

    Raises:
        StateDictError: an empty model state dict under ``strict``, or an
            optimizer that holds a parameter the model does not.
        ValueError: ``broadcast_from_rank0`` without ``full_state_dict``.
    """
    warn_submodules_deprecated(submodules, "get_state_dict", stacklevel=2)
    options = checked_options(options, "get_state_dict")
    optims = as_optimizer_list(optimizers)
    model_state = functional_model_state_dict(model, options, submodules, "get_state_dict")
    optim_state = functional_optimizer_state_dict(model, optims, options) if optims else {}
    return model_state, optim_state


def set_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    model_state_dict: Mapping[str, Any],
    optim_state_dict: Mapping[str, Any],
    options: StateDictOptions | None = None,
) -> IncompatibleKeys:
    """Load a model state dict and its optimizers' state dict, as :func:`get_state_dict` gave them.

    The optimizers are loaded first, then the model (PyTorch's order).

    Args:
        model: the model to load into.
        optimizers: the optimizer(s) to load into, or none (an empty
            iterable: the model alone).
        model_state_dict: as for :func:`set_model_state_dict`; ``{}`` loads
            the optimizers only.
        optim_state_dict: as for :func:`set_optimizer_state_dict`.
        options: as for the two functions above.

    Returns:
        The model's missing and unexpected keys (both empty under ``strict``,
        and when the model was not loaded).

    Raises:
        StateDictError: nothing to load (no model state dict and no
            optimizer), an empty optimizer state dict, or what the two
            functions above raise.
        ValueError: ``broadcast_from_rank0`` without ``full_state_dict``.
    """
    model_state_dict = keyed_by_name(model, model_state_dict, "set_state_dict", stacklevel=2)
    options = checked_options(options, "set_state_dict")
    optims = as_optimizer_list(optimizers)
    if not model_state_dict and not optims:
        raise StateDictError(
            "set_state_dict: model_state_dict is empty and optimizers is empty, so there is "
            "nothing to load; pass the model state dict, the optimizers, or both"
        )
    if optims:
        load_functional_optimizer_state_dict(
            model, optims, optim_state_dict, options, "set_state_dict"
        )
    if not model_state_dict:
        return IncompatibleKeys(missing_keys=[], unexpected_keys=[])
    return load_functional_model_state_dict(model, model_state_dict, options, "set_state_dict")
