"""``FullyShardedDataParallel.clip_grad_norm_``: one global norm over sharded and whole gradients.

A flat unit's gradient lives in shards: each rank's share of the norm is
summed (or, for the inf-norm, maxed) across the shard group, then combined
with the norm of the gradients every rank holds whole (ignored modules).

[Note: clipping when nothing is split]
When no unit is split (NO_SHARD everywhere, or one rank), every rank holds
every gradient whole, and PyTorch's wrapper hands the model's parameters to
``torch.nn.utils.clip_grad_norm_``, which computes the norms in the
gradients' own dtype. With low-precision gradients
(``keep_low_precision_grads``) that rounds differently from the sharded
path's fp32 norms, so shard takes the same route there; the sharded path
sums fp32 norms in PyTorch's order.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.distributed as dist
from torch import nn

from shard_runtime._state import states_in

__all__ = ["clip_grad_norm"]


def clip_grad_norm(root: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
    """Global norm over sharded gradients (summed across the shard axis) and replicated ones."""
    held: dict[int, nn.Parameter] = {}
    shard_group: dist.ProcessGroup | None = None
    shard_world = 1
    # PyTorch sums the per-parameter norms unit by unit (the outermost first, then the inner
    # ones in module order, each unit's parameters in its flat buffer's order): summing in the
    # same order rounds as there.
    any_split = False
    for s in states_in([root]):
        layout = s.unit.layout
        shard_group, shard_world = s.unit.shard_group, s.unit.shard_world
        any_split = any_split or shard_world > 1
        for p in layout.registered_params():
            held.setdefault(id(p), p)
    if not any_split:  # See [Note: clipping when nothing is split].
        return torch.nn.utils.clip_grad_norm_(list(root.parameters()), max_norm, norm_type)
    ordered = list(held.values())
    sharded = [p.grad for p in ordered if p.grad is not None]
    replicated = [p.grad for p in root.parameters() if id(p) not in held and p.grad is not None]
    device = (sharded or replicated or [torch.zeros(())])[0].device
    if math.isinf(norm_type):
        local = _norm(sharded, norm_type, device)
        if shard_group is not None and shard_world > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=shard_group)
        total = torch.maximum(local, _norm(replicated, norm_type, device))
    else:
        local = _norm(sharded, norm_type, device) ** norm_type
        if shard_group is not None and shard_world > 1:
            dist.all_reduce(local, group=shard_group)
        total = (local + _norm(replicated, norm_type, device) ** norm_type) ** (1.0 / norm_type)
    coef = max_norm / (total + 1e-6)
    grads = [*sharded, *replicated]
    if coef < 1:
        for grad in grads:
            grad.mul_(coef.to(grad.dtype))
    if not grads:
        warnings.warn(
            f"FullyShardedDataParallel.clip_grad_norm_(): rank {dist.get_rank()} has no "
            f"gradients; the total norm is returned in {total.dtype}, not the gradients' dtype",
            UserWarning,
            stacklevel=3,
        )
        return total
    # The gradients' widest dtype, as PyTorch returns it (bf16 gradients: a bf16 norm).
    return total.to(functools.reduce(torch.promote_types, [g.dtype for g in grads]))


def _norm(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), device=device)
    norms = torch.stack([torch.linalg.vector_norm(g.float(), norm_type) for g in grads])
    total: torch.Tensor = torch.linalg.vector_norm(norms, norm_type)
    return total
