"""What a rank holds for training, counted as the bytes of the storages behind its tensors.

``shard train``'s measurements and ``shard_testing.simulate`` both report it,
and ``shard plan`` predicts it, so there is one way to count: each storage
once (views of one buffer, a unit's gradients in one reduce-scatter output),
padding included (it is allocated), DTensors by their local tensors.
Storages are told apart by identity, not address, so fake tensors (address
0) count as well.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["StateBytes", "held_bytes", "state_bytes"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    assert isinstance(local, torch.Tensor)
    return local


def held_bytes(tensors: Iterable[torch.Tensor], *, meta: bool = False) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local tensors).

    Meta tensors (shape-only placeholders, which hold no memory) count only
    with ``meta=True``: a simulation that builds its model on the meta device
    counts what those tensors would hold.
    """
    seen: dict[int, int] = {}
    for tensor in tensors:
        local = _local(tensor)
        if local.device.type == "meta" and not meta:
            continue
        storage = local.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class StateBytes:
    """What one rank holds for training, in bytes.

    Attributes:
        params: The sharded parameters (the storages behind them, padding included).
        grads: Their gradients.
        optim: The optimizer's state tensors.
    """

    params: int
    grads: int
    optim: int

    @property
    def total(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self.params + self.grads + self.optim


def state_bytes(
    model: nn.Module, optim: torch.optim.Optimizer, *, meta: bool = False
) -> StateBytes:
    """What ``model``'s parameters, their ``.grad`` and ``optim``'s state hold on this rank."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = [
        value
        for state in optim.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
    return StateBytes(
        params=held_bytes(params, meta=meta),
        grads=held_bytes(grads, meta=meta),
        optim=held_bytes(states, meta=meta),
    )
