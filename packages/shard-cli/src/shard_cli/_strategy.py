"""How ``shard train`` shards its model: a strategy name becomes a mesh and front-end options.

Both front ends express the four strategies, so the demo (and ``shard plan``)
can put them side by side:

=========== =============================================== ==========================
strategy    ``fully_shard``                                 wrapper
=========== =============================================== ==========================
full        1-D mesh, ``reshard_after_forward=None``        ``FULL_SHARD``
grad-op     1-D mesh, ``reshard_after_forward=False``       ``SHARD_GRAD_OP``
no-shard    ``(world, 1)`` mesh (replicas of one shard)     ``NO_SHARD``
hybrid      ``(world / s, s)`` mesh, reshard after forward  ``HYBRID_SHARD``, same mesh
=========== =============================================== ==========================

``s`` is the shard group size (``--shard-size``, default: the ranks of one
machine). ``bf16`` computes in bfloat16 and reduces gradients in float32.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shard_cli._options import Frontend, Precision, Strategy
from shard_cli.gpt import Block
from shard_comms import build_mesh
from shard_runtime import (
    CPUOffload,
    CPUOffloadPolicy,
    FullyShardedDataParallel,
    MixedPrecision,
    MixedPrecisionPolicy,
    ModuleWrapPolicy,
    OffloadPolicy,
    ShardingStrategy,
    WrapPolicyLike,
    apply_wrap_policy,
)

__all__ = [
    "ShardLayout",
    "compute_dtype",
    "resolve_policy",
    "shard_layout",
    "shard_model",
]

_WRAPPER_STRATEGIES = {
    "full": ShardingStrategy.FULL_SHARD,
    "grad-op": ShardingStrategy.SHARD_GRAD_OP,
    "no-shard": ShardingStrategy.NO_SHARD,
    "hybrid": ShardingStrategy.HYBRID_SHARD,
}


# The start of the wrapper's warning for a unit of frozen and trainable parameters.
_MIXED_UNIT_WARNING = r"FullyShardedDataParallel\(.*\): frozen and trainable parameters share"


@dataclass(frozen=True)
class ShardLayout:
    """How ``world`` ranks split into replicas and shard groups for one strategy.

    Attributes:
        world: Number of ranks.
        shard: Ranks that share one copy of the model (the shard group).
        replicate: Number of copies (``world // shard``).
    """

    world: int
    shard: int
    replicate: int


def shard_layout(strategy: Strategy, world: int, shard_size: int | None = None) -> ShardLayout:
    """The replicate x shard split ``strategy`` makes of ``world`` ranks.

    ``shard_size`` (``hybrid`` only) defaults to ``LOCAL_WORLD_SIZE`` (the ranks
    of one machine), or the whole world outside a launcher.

    Raises:
        ValueError: ``shard_size`` does not divide ``world``.
    """
    if strategy == "no-shard":
        return ShardLayout(world, 1, world)
    if strategy != "hybrid":
        return ShardLayout(world, world, 1)
    size = shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % size:
        raise ValueError(
            f"--strategy hybrid: --shard-size {size} does not divide the world size {world}; "
            "pick a shard group size that divides it (the ranks of one machine, usually)"
        )
    return ShardLayout(world, size, world // size)


def compute_dtype(precision: Precision) -> torch.dtype:
    """The dtype forward and backward compute in."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def resolve_policy(name: str, options: Mapping[str, Any] | None = None) -> WrapPolicyLike:
    """The wrap policy ``--wrap-policy name`` (with ``--wrap-option``\\ s) means.

    ``blocks``: each :class:`~shard_cli.gpt.Block` is a unit; ``none``: the
    root is the only unit; anything else is a policy name for the plugin
    registry (``transformer``, ``size``), resolved by the runtime, with
    ``options`` as its keyword options (``(name, options)``, the runtime's
    form). ``blocks`` and ``none`` take no options.
    """
    if name in ("blocks", "none"):
        if options:
            raise ValueError(
                f"--wrap-policy {name} takes no options, got --wrap-option "
                f"{', '.join(sorted(options))}; options belong to a registered policy "
                "(--wrap-policy size --wrap-option min_num_params=1000000)"
            )
        return ModuleWrapPolicy({Block}) if name == "blocks" else None
    return (name, dict(options)) if options else name


def _mesh(strategy: Strategy, layout: ShardLayout, device_type: str) -> DeviceMesh:
    if strategy in ("full", "grad-op"):
        return build_mesh(device_type=device_type)
    return build_mesh((layout.replicate, layout.shard), device_type=device_type)


def shard_model(
    model: nn.Module,
    *,
    frontend: Frontend,
    strategy: Strategy,
    layout: ShardLayout,
    precision: Precision,
    cpu_offload: bool,
    policy: WrapPolicyLike,
    device: torch.device,
    use_orig_params: bool = False,
) -> tuple[nn.Module, DeviceMesh]:
    """Shard ``model`` (a plain model on the CPU) and return it with the mesh it shards over.

    ``use_orig_params`` (the wrapper only; ``fully_shard`` keeps every
    parameter its own): the wrapper's parameters stay the model's, views of
    the flat shard, which a unit that mixes frozen and trainable parameters
    needs (``shard train`` passes it when some parameter is frozen). The
    wrapper's warning that the unit's full gradient then spans its frozen
    parameters too is silenced: ``shard plan`` counts those bytes, and LoRA
    puts adapters beside their frozen base in every block by design.

    Collective: every rank calls it with the same arguments.
    """
    mesh = _mesh(strategy, layout, device.type)
    dtype = compute_dtype(precision)
    low = dtype != torch.float32
    if frontend == "fully_shard":
        apply_wrap_policy(
            model,
            policy,
            mesh=mesh,
            # None: blocks reshard after forward, the root keeps its parameters for
            # backward (PyTorch's default); True would reshard the root too.
            reshard_after_forward=None if strategy in ("full", "hybrid") else False,
            mp_policy=MixedPrecisionPolicy(
                param_dtype=dtype if low else None,
                reduce_dtype=torch.float32 if low else None,
            ),
            offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
        )
        return model, mesh
    make: Callable[..., nn.Module] = FullyShardedDataParallel
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_MIXED_UNIT_WARNING, category=UserWarning)
        wrapped = make(
            model,
            sharding_strategy=_WRAPPER_STRATEGIES[strategy],
            auto_wrap_policy=policy,
            mixed_precision=(
                MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32) if low else None
            ),
            cpu_offload=CPUOffload(offload_params=cpu_offload),
            device_id=device if device.type != "cpu" else None,
            device_mesh=mesh if strategy != "no-shard" else None,
            use_orig_params=use_orig_params,
        )
    return wrapped, mesh
