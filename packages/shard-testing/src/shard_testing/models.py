"""Small models that parity tests of both front ends train, sharded and in one process.

Sizes are chosen so that shards are uneven at 3 and 4 ranks (10 rows, 21
rows) and every block holds weights and biases: the cases where sharding
bugs hide.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "DIM_IN",
    "DIM_OUT",
    "HIDDEN",
    "LinearStack",
    "ResidualBlock",
    "ToyNet",
    "check_toy_parity",
    "data_parallel_mesh",
    "sharded_toy_net",
    "toy_batches",
    "toy_reference",
    "train_toy",
    "uneven_mlp",
    "wrapper_full_params",
]

DIM_IN, HIDDEN, DIM_OUT = 6, 10, 3


class ResidualBlock(nn.Module):
    """``x + outer(tanh(inner(x)))``: two linear layers, 10 and 21 rows."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(HIDDEN, 2 * HIDDEN + 1)
        self.outer = nn.Linear(2 * HIDDEN + 1, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.outer(torch.tanh(self.inner(x)))
        return out


class ToyNet(nn.Module):
    """An input projection, ``blocks`` residual blocks in a ``ModuleList``, a head."""

    def __init__(self, blocks: int = 3, *, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(DIM_IN, HIDDEN)
        self.blocks = nn.ModuleList(ResidualBlock() for _ in range(blocks))
        self.head = nn.Linear(HIDDEN, DIM_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(h)
        return out


def sharded_toy_net(
    shard: Callable[..., object],
    *,
    mesh: DeviceMesh | None = None,
    blocks: int = 3,
    seed: int = 0,
    zeroed: bool = False,
) -> ToyNet:
    """``ToyNet(blocks, seed=seed)`` with ``shard`` applied to each block, then to the root.

    The layout most multi-rank tests want: one unit per residual block and
    the root's own parameters (embedding, head) in the root unit. shard-testing
    sits below shard-runtime, so the caller passes the sharding function:
    ``shard_runtime.fully_shard``, or PyTorch's ``fully_shard`` as the
    reference; each is called as ``shard(module, mesh=mesh)``. ``mesh``
    defaults to a 1-D CPU mesh over the whole world (a process group must
    exist). ``zeroed`` zeroes every parameter after sharding (each rank its
    shard), so that a value a later load fails to write shows.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if mesh is None:
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    model = ToyNet(blocks, seed=seed)
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    if zeroed:
        with torch.no_grad():
            for param in model.parameters():
                param.zero_()
    return model


def toy_batches(
    world_size: int, steps: int, *, batch: int = 4, microbatches: int = 1, seed: int = 1234
) -> list[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """``[step][microbatch][rank] -> (x, y)`` for :class:`ToyNet`, the same in every process."""
    g = torch.Generator().manual_seed(seed)
    return [
        [
            [
                (torch.randn(batch, DIM_IN, generator=g), torch.randn(batch, DIM_OUT, generator=g))
                for _ in range(world_size)
            ]
            for _ in range(microbatches)
        ]
        for _ in range(steps)
    ]


TOY_LR = 0.05
"""The AdamW learning rate of the toy parity runs, sharded and reference alike."""


def toy_reference(
    world_size: int, steps: int, model: nn.Module | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses per step and final parameters of one process on the ranks' concatenated batches.

    The single-process side of a :func:`train_toy` run (see [Note: Why sharded
    training must match the reference] in ``reference.py``).
    """
    model = model if model is not None else ToyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=TOY_LR)
    losses = []
    for step in toy_batches(world_size, steps):
        x = torch.cat([x for x, _ in step[0]])
        y = torch.cat([y for _, y in step[0]])
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        optim.step()
        optim.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train_toy(
    model: nn.Module, steps: int, after_backward: Callable[[], None] | None = None
) -> list[float]:
    """``steps`` of AdamW on this rank's slice of :func:`toy_batches`; the ranks' mean loss.

    Run on every rank of a sharded ``model``; ``after_backward`` runs between
    the backward and the optimizer step (to adjust gradients, say).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    optim = torch.optim.AdamW(model.parameters(), lr=TOY_LR)
    losses = []
    for step in toy_batches(world, steps):
        x, y = step[0][rank]
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        if after_backward is not None:
            after_backward()
        optim.step()
        optim.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def wrapper_full_params(model: nn.Module, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The original parameters ``names`` of a wrapped model, read inside summon_full_params.

    ``model`` is a ``FullyShardedDataParallel`` (shard's or PyTorch's: both
    offer the static ``summon_full_params``); names are the unwrapped ones.
    """
    out = {}
    with type(model).summon_full_params(model, writeback=False):  # type: ignore[attr-defined]
        for name in names:
            owner: Any = model
            *path, leaf = name.split(".")
            for part in path:
                owner = owner[int(part)] if part.isdigit() else getattr(owner, part)
            out[name] = getattr(owner, leaf).detach().clone()
    return out


def check_toy_parity(results: Sequence[Mapping[str, Any]], world_size: int, steps: int) -> None:
    """Each rank's ``{"losses", "params"}`` equals :func:`toy_reference` (fp32 tolerances)."""
    ref_losses, ref_params = toy_reference(world_size, steps)
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses))
        assert list(result["params"]) == list(ref_params)
        for name, value in ref_params.items():
            torch.testing.assert_close(result["params"][name], value)


class LinearStack(nn.Module):
    """``layers`` bias-free ``width`` x ``width`` linear layers: equal units for memory tests."""

    def __init__(self, layers: int = 16, width: int = 1024) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def uneven_mlp() -> nn.Sequential:
    """Linear 5->7, tanh, 7->6, tanh, 6->3 (seed 0): 7 and 3 rows shard unevenly over 2 ranks."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3))


def data_parallel_mesh(*, hybrid: bool = False) -> DeviceMesh:
    """A CPU mesh over the world: 1-D, or ``(2, world // 2)`` named replicate, shard."""
    world = dist.get_world_size()
    if hybrid:
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))
