"""The optimizer state-dict methods of ``FullyShardedDataParallel``, with PyTorch's names.

All of them are static: they take the wrapped model and its optimizer. The
work (gathering flat optimizer state into per-parameter tensors and cutting
it back) belongs to shard-checkpoint, reached through the plugin registry;
without it installed every method raises an error naming the distribution.
State dicts are keyed by the unwrapped model's parameter names, so they load
into another world size, another wrapping, the other front end, or a plain
model (after :meth:`rekey_optim_state_dict`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shard_core import get_registry
from shard_runtime._state_dict_type import (
    FullOptimStateDictConfig,
    OptimStateKeyType,
    StateDictType,
    settings_of,
)

__all__ = ["OptimStateDictMethods"]


class OptimStateDictMethods:
    """Mixed into ``FullyShardedDataParallel``; see the module docstring."""

    @staticmethod
    def optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: Mapping[str, Any] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """``optim``'s state in the form the model's state-dict type asks for (a collective).

        ``FULL_STATE_DICT``: full tensors per parameter name, on the CPU by
        default, only on rank 0 with ``FullOptimStateDictConfig(rank0_only=True)``.
        ``SHARDED_STATE_DICT`` and ``LOCAL_STATE_DICT`` (as in PyTorch, whose
        local optimizer state dict is its sharded one): each parameter's
        state as a ``Shard(0)`` DTensor cut like ``torch.chunk``.

        Args:
            model: the wrapped model ``optim`` trains.
            optim: its optimizer.
            optim_state_dict: ``optim.state_dict()`` if the caller already took it.
            group: must be ``None``: the groups are the model's own.
        """
        _no_group(group, "optim_state_dict")
        settings = settings_of(model)
        config = settings.optim_state_dict_config
        kind = settings.state_dict_type
        return _gathered(
            model,
            optim,
            StateDictType.SHARDED_STATE_DICT if kind is StateDictType.LOCAL_STATE_DICT else kind,
            offload_to_cpu=config.offload_to_cpu,
            rank0_only=isinstance(config, FullOptimStateDictConfig) and config.rank0_only,
            optim_state_dict=optim_state_dict,
        )

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: Mapping[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """What ``optim.load_state_dict`` takes to load ``optim_state_dict`` (a collective).

        ``optim_state_dict`` is one :meth:`optim_state_dict` returned, full or
        sharded, from any world size or wrapping (PyTorch's too: its
        ``ShardedTensor`` s load as the DTensors they describe); with
        ``FullOptimStateDictConfig(rank0_only=True)`` only rank 0's is read
        and its tensors are broadcast one at a time.

        Args:
            load_directly: also load the result into ``optim``.
            is_named_optimizer: must be ``False`` (torchrec's named optimizers
                are not supported).
            group: must be ``None``.
        """
        _no_group(group, "optim_state_dict_to_load")
        if is_named_optimizer:
            raise ValueError(
                "optim_state_dict_to_load: is_named_optimizer=True is not supported; pass a "
                "torch.optim optimizer"
            )
        config = settings_of(model).optim_state_dict_config
        loadable = _loadable(
            model,
            optim,
            optim_state_dict,
            broadcast_from_rank0=isinstance(config, FullOptimStateDictConfig) and config.rank0_only,
        )
        if load_directly:
            optim.load_state_dict(loadable)
        return loadable

    @staticmethod
    def full_optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_input: object = None,
        rank0_only: bool = True,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """Full optimizer state on the CPU per parameter name; ``{}`` on ranks but 0 by default."""
        _no_optim_input(optim_input, "full_optim_state_dict")
        _no_group(group, "full_optim_state_dict")
        return _gathered(
            model,
            optim,
            StateDictType.FULL_STATE_DICT,
            offload_to_cpu=True,
            rank0_only=rank0_only,
        )

    @staticmethod
    def sharded_optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """Optimizer state per parameter name as ``Shard(0)`` DTensors (for ``save``)."""
        _no_group(group, "sharded_optim_state_dict")
        return _gathered(
            model,
            optim,
            StateDictType.SHARDED_STATE_DICT,
            offload_to_cpu=False,
            rank0_only=False,
        )

    @staticmethod
    def shard_full_optim_state_dict(
        full_optim_state_dict: Mapping[str, Any],
        model: nn.Module,
        optim_input: object = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """This rank's loadable state from a full one every rank holds (no communication)."""
        _no_optim_input(optim_input, "shard_full_optim_state_dict")
        return _loadable(
            model,
            _need_optim(optim, "shard_full_optim_state_dict"),
            full_optim_state_dict,
            broadcast_from_rank0=False,
        )

    @staticmethod
    def scatter_full_optim_state_dict(
        full_optim_state_dict: Mapping[str, Any] | None,
        model: nn.Module,
        optim_input: object = None,
        optim: torch.optim.Optimizer | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """This rank's loadable state from a full one only rank 0 holds (others pass ``None``)."""
        _no_optim_input(optim_input, "scatter_full_optim_state_dict")
        _no_group(group, "scatter_full_optim_state_dict")
        return _loadable(
            model,
            _need_optim(optim, "scatter_full_optim_state_dict"),
            full_optim_state_dict or {},
            broadcast_from_rank0=True,
        )

    @staticmethod
    def flatten_sharded_optim_state_dict(
        sharded_optim_state_dict: Mapping[str, Any],
        model: nn.Module,
        optim: torch.optim.Optimizer,
    ) -> dict[str, Any]:
        """This rank's loadable state from a sharded one (any world size; a collective)."""
        return _loadable(model, optim, sharded_optim_state_dict, broadcast_from_rank0=False)

    @staticmethod
    def rekey_optim_state_dict(
        optim_state_dict: Mapping[str, Any],
        optim_state_key_type: OptimStateKeyType,
        model: nn.Module,
        optim_input: object = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """Key ``optim_state_dict`` by parameter name or by position (no communication).

        ``PARAM_ID`` numbers parameters as a plain optimizer over the unwrapped
        model does (``optim``'s order if given, else the model's), so a full
        state dict of a wrapped model loads into a plain optimizer, and
        ``PARAM_NAME`` turns a plain optimizer's state dict into one
        :meth:`shard_full_optim_state_dict` takes.
        """
        _no_optim_input(optim_input, "rekey_optim_state_dict")
        if not isinstance(optim_state_key_type, OptimStateKeyType):
            raise TypeError(
                "rekey_optim_state_dict: optim_state_key_type must be an OptimStateKeyType, "
                f"got {optim_state_key_type!r}"
            )
        return (
            get_registry()
            .state_dict_backend()
            .rekey_optim_state_dict(optim_state_dict, optim_state_key_type.name, model, optim)
        )


def _gathered(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    state_dict_type: StateDictType,
    *,
    offload_to_cpu: bool,
    rank0_only: bool,
    optim_state_dict: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``optim``'s state per parameter name, from the state-dict backend (a collective)."""
    return (
        get_registry()
        .state_dict_backend()
        .optim_state_dict(
            model,
            optim,
            state_dict_type.name,
            offload_to_cpu=offload_to_cpu,
            rank0_only=rank0_only,
            optim_state_dict=optim_state_dict,
        )
    )


def _loadable(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: Mapping[str, Any],
    *,
    broadcast_from_rank0: bool,
) -> dict[str, Any]:
    """What ``optim.load_state_dict`` takes, from the state-dict backend (a collective)."""
    return (
        get_registry()
        .state_dict_backend()
        .optim_state_dict_to_load(
            model, optim, optim_state_dict, broadcast_from_rank0=broadcast_from_rank0
        )
    )


def _no_group(group: dist.ProcessGroup | None, method: str) -> None:
    if group is not None:
        raise ValueError(
            f"{method}: group must be None; the process groups are the model's own (given "
            "to FullyShardedDataParallel)"
        )


def _no_optim_input(optim_input: object, method: str) -> None:
    if optim_input is not None:
        raise ValueError(
            f"{method}: optim_input is not supported (PyTorch deprecated it); pass optim="
        )


def _need_optim(optim: torch.optim.Optimizer | None, method: str) -> torch.optim.Optimizer:
    if optim is None:
        raise ValueError(
            f"{method}: pass optim=, the optimizer to load into (optim_input is not supported)"
        )
    return optim
