"""The state dicts of ``FullyShardedDataParallel``, served through the plugin registry.

The wrapper lives below this package, so it cannot import it; it asks the
registry for a :class:`~shard_core.protocols.StateDictBackend` and this
module answers (``shard_checkpoint.plugin``). Everything is the functional
API's own code (``_model.py``, ``_optim*.py``) under the wrapper's names:
``StateDictType`` members arrive as their names, config options as keywords.
State dicts to load may hold PyTorch's ``ShardedTensor`` s (its wrapper's
sharded and local state dicts): they load as the DTensors they describe.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shard_checkpoint._model import Caller, Kind, load_model_state_dict, model_state_dict
from shard_checkpoint._optim import optimizer_state_dict, optimizer_state_dict_to_load
from shard_checkpoint._optim_rekey import rekey_optimizer_state_dict
from shard_checkpoint._sharded_tensor import dtensors_for_sharded_tensors

__all__ = ["WrapperStateDictBackend"]

_WRAPPER = Caller("FullyShardedDataParallel.load_state_dict", "pass strict=False")


def _kind(state_dict_type: str) -> Kind:
    kinds = {
        "FULL_STATE_DICT": Kind.FULL,
        "SHARDED_STATE_DICT": Kind.SHARDED,
        "LOCAL_STATE_DICT": Kind.LOCAL,
    }
    if state_dict_type not in kinds:
        raise ValueError(
            f"unknown state_dict_type {state_dict_type!r}; expected one of {sorted(kinds)}"
        )
    return kinds[state_dict_type]


class WrapperStateDictBackend:
    """Model and optimizer state dicts of ``FullyShardedDataParallel`` (see the module doc)."""

    def model_state_dict(
        self,
        module: nn.Module,
        state_dict_type: str,
        *,
        offload_to_cpu: bool,
        rank0_only: bool,
    ) -> dict[str, Any]:
        """``module``'s state dict: full plain tensors, ``Shard(0)`` DTensors, or flat shards."""
        return model_state_dict(
            module, _kind(state_dict_type), offload_to_cpu=offload_to_cpu, rank0_only=rank0_only
        )

    def load_model_state_dict(
        self,
        module: nn.Module,
        state_dict: Mapping[str, Any],
        state_dict_type: str,
        *,
        strict: bool,
    ) -> tuple[list[str], list[str]]:
        """Load a state dict of that type into ``module``'s shards, one unit at a time."""
        missing, unexpected = load_model_state_dict(
            module,
            dtensors_for_sharded_tensors(state_dict),
            _kind(state_dict_type),
            strict=strict,
            broadcast_from_rank0=False,
            caller=_WRAPPER,
        )
        return missing, unexpected

    def optim_state_dict(
        self,
        module: nn.Module,
        optim: torch.optim.Optimizer,
        state_dict_type: str,
        *,
        offload_to_cpu: bool,
        rank0_only: bool,
        optim_state_dict: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        """``optim``'s state keyed by parameter name, full or sharded per ``state_dict_type``."""
        return optimizer_state_dict(
            module,
            optim,
            full=_kind(state_dict_type) is Kind.FULL,
            offload_to_cpu=offload_to_cpu,
            rank0_only=rank0_only,
            local_state_dicts=None if optim_state_dict is None else [optim_state_dict],
        )

    def optim_state_dict_to_load(
        self,
        module: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: Mapping[str, Any],
        *,
        broadcast_from_rank0: bool,
    ) -> dict[str, Any]:
        """The positional state dict ``optim.load_state_dict`` takes, for this rank's shards."""
        (loadable,) = optimizer_state_dict_to_load(
            module,
            optim,
            dtensors_for_sharded_tensors(optim_state_dict),
            strict=True,
            broadcast_from_rank0=broadcast_from_rank0,
        )
        return loadable

    def rekey_optim_state_dict(
        self,
        optim_state_dict: Mapping[str, Any],
        key_type: str,
        module: nn.Module,
        optim: torch.optim.Optimizer | None,
    ) -> dict[str, Any]:
        """``optim_state_dict`` keyed by parameter name (``"PARAM_NAME"``) or position."""
        return rekey_optimizer_state_dict(optim_state_dict, key_type, module, optim)
