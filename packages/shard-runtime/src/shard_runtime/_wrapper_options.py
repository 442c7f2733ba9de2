"""Options of ``FullyShardedDataParallel``, with PyTorch's names, fields and defaults.

A script written for PyTorch's wrapper switches by changing its import line,
so these mirror ``torch.distributed.fsdp``'s ``ShardingStrategy``,
``BackwardPrefetch``, ``MixedPrecision`` and ``CPUOffload``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["BackwardPrefetch", "CPUOffload", "MixedPrecision", "ShardingStrategy"]


class ShardingStrategy(enum.Enum):
    """How a wrapped unit's parameters, gradients and optimizer state are spread."""

    # Shard everything; free full parameters after forward and gather them again for backward.
    FULL_SHARD = enum.auto()
    # Shard gradients and optimizer state; keep full parameters from forward to backward.
    SHARD_GRAD_OP = enum.auto()
    # Shard nothing: every rank keeps everything and gradients are all-reduced (DDP).
    NO_SHARD = enum.auto()
    # FULL_SHARD within a shard group (a node), replicate across groups.
    HYBRID_SHARD = enum.auto()
    # SHARD_GRAD_OP within a shard group, replicate across groups.
    _HYBRID_SHARD_ZERO2 = enum.auto()


HYBRID_STRATEGIES = frozenset({ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2})
RESHARD_AFTER_FORWARD = frozenset({ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD})


class BackwardPrefetch(enum.Enum):
    """When the next unit's all-gather is started during backward."""

    # When the current unit's backward starts (more overlap, more memory).
    BACKWARD_PRE = enum.auto()
    # When the current unit's gradients are ready (less memory).
    BACKWARD_POST = enum.auto()


@dataclass
class MixedPrecision:
    """Dtypes the wrapper computes, communicates and keeps buffers in.

    Attributes:
        param_dtype: dtype of the unsharded parameters (forward, backward and
            the all-gather). ``None``: the parameters' own dtype.
        reduce_dtype: dtype gradients are reduced in. ``None``: ``param_dtype``.
        buffer_dtype: dtype buffers are cast to. ``None``: left as they are.
        keep_low_precision_grads: keep the reduced gradients in ``param_dtype``
            instead of casting them back to the parameters' dtype.
        cast_forward_inputs: cast floating-point forward inputs of every unit
            to ``param_dtype``.
        cast_root_forward_inputs: cast floating-point forward inputs of the
            root unit to ``param_dtype``.
        _module_classes_to_ignore: with an ``auto_wrap_policy``, modules of
            these classes become units of their own without mixed precision
            (batch norm is unstable in low precision).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type[nn.Module]] = (_BatchNorm,)


@dataclass
class CPUOffload:
    """Whether sharded parameters (and so gradients and optimizer state) live on the CPU.

    Attributes:
        offload_params: keep the flat shards on the CPU and copy each unit to
            the compute device for its all-gather.
    """

    offload_params: bool = False
