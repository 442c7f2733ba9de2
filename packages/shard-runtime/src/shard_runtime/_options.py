"""User options of ``fully_shard``: mixed precision, offloading and data-parallel mesh axes.

Same names, fields and defaults as PyTorch's ``fully_shard`` options, so a
script switches by changing its import line.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shard_core.errors import LayoutError

__all__ = ["CPUOffloadPolicy", "DataParallelMeshDims", "MixedPrecisionPolicy", "OffloadPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes a unit computes, communicates and returns in.

    Attributes:
        param_dtype: dtype of the unsharded parameters, so of the all-gather
            and of forward/backward compute. ``None``: the parameters' own dtype.
        reduce_dtype: dtype gradients are reduced in. ``None``: ``param_dtype``
            (or the parameters' own dtype when that is ``None`` too).
        output_dtype: dtype floating-point forward outputs are cast to.
            ``None``: outputs are left as computed.
        cast_forward_inputs: whether floating-point forward inputs are cast to
            ``param_dtype`` before the unit's forward.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        # Parameters compute and gradients reduce in these dtypes: an integer one
        # would make trainable parameters integer, which autograd refuses deep inside.
        for field_name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, field_name)
            if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
                raise LayoutError(
                    f"MixedPrecisionPolicy: {field_name}={dtype} is not a floating-point "
                    "dtype, so the trainable parameters would become integers, which cannot "
                    f"require grad; pass a floating-point dtype (e.g. {field_name}="
                    "torch.bfloat16) or None"
                )


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state stay on the device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients (and so optimizer state) on the CPU.

    Each unit's shards are copied to the compute device for its all-gather and
    its reduced gradient shard is copied back; the optimizer steps on the CPU.

    Attributes:
        pin_memory: pin the CPU shards so host-device copies can overlap
            compute. Ignored where no accelerator is present.
    """

    pin_memory: bool = True


@dataclass(frozen=True)
class DataParallelMeshDims:
    """Names of the data-parallel axes of a whole mesh, for ``fully_shard(dp_mesh_dims=...)``.

    With it, ``mesh`` is the whole mesh (data and model parallel axes) and
    every parameter is already a DTensor on it, ``Replicate()`` on the axes
    named here; ``fully_shard`` shards them over those axes.

    Attributes:
        shard: the axis name (or names, flattened into one axis) parameters are
            sharded over. ``None``: no sharding axis.
        replicate: the axis name (or names, flattened) shards are replicated
            over (HSDP). ``None``: no replication axis.

    At least one of them must be given.
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError(
                "DataParallelMeshDims: give shard= (the axis to shard parameters over) and/or "
                "replicate= (the axis to replicate shards over); both are None"
            )

    @property
    def shard_names(self) -> tuple[str, ...]:
        """``shard`` as a tuple of axis names (empty when ``None``)."""
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        """``replicate`` as a tuple of axis names (empty when ``None``)."""
        return _names(self.replicate)


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)
