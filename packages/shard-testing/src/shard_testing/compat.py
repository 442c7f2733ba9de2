"""Helpers for tests that run the same user code under PyTorch and under shard.

A compat test runs one rank function twice, with ``impl="torch"`` and
``impl="shard"``, and compares the plain values it returns (names, shapes,
losses, exception types). The helpers here are the pieces every such test
(and many single-library tests) needs: outcomes of a call as strings, a 1-D
CPU mesh over the pool's ranks, the library namespace that ``impl`` names,
custom collectives that count what they are asked to do (the protocol of
``set_custom_all_gather`` / ``set_custom_reduce_scatter``), and toy models.

Nothing here imports ``torch.distributed.fsdp`` or ``shard_runtime`` when
the module is imported: :func:`fsdp_namespace` imports the one it is asked
for, so that a test of shard alone never loads PyTorch's FSDP, and
shard-testing keeps depending on shard-core only.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "BranchNet",
    "CountingAllGather",
    "CountingReduceScatter",
    "Impl",
    "TPBlock",
    "TPModel",
    "cpu_mesh",
    "error",
    "error_type",
    "fsdp_namespace",
    "torch_fsdp_collectives",
]

Impl = Literal["torch", "shard"]
"""Which library a compat rank function runs: PyTorch's or shard's."""

_NAMESPACES: dict[str, str] = {"torch": "torch.distributed.fsdp", "shard": "shard_runtime"}


def error(fn: Callable[[], object]) -> str:
    """``"<Type>: <message>"`` of what ``fn()`` raises, or ``"no error"``.

    Plain strings pickle across ranks and compare in one ``==``; tests that
    check a message's wording use this, tests that compare with PyTorch
    (whose wording differs) use :func:`error_type`.
    """
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def error_type(fn: Callable[[], object]) -> str:
    """The class name of what ``fn()`` raises (``"ValueError"``), or ``"no error"``."""
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__
    return "no error"


def cpu_mesh(name: str | None = None) -> DeviceMesh:
    """A 1-D CPU mesh over every rank of the default process group, axis ``name`` if given."""
    names = (name,) if name is not None else None
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=names)


def fsdp_namespace(impl: Impl) -> ModuleType:
    """``torch.distributed.fsdp`` or ``shard_runtime``: where ``impl`` keeps its FSDP names.

    Both export ``fully_shard``, ``FullyShardedDataParallel``,
    ``ShardingStrategy``, ``MixedPrecisionPolicy`` ... under the same names,
    so a rank function reads ``fsdp_namespace(impl).fully_shard``. Imported
    on call (see the module doc); ``"shard"`` needs shard-runtime installed.
    """
    if impl not in _NAMESPACES:
        raise ValueError(f"impl must be 'torch' or 'shard', got {impl!r}")
    return importlib.import_module(_NAMESPACES[impl])


class BranchNet(nn.Module):
    """An embedding, two linears, and a side branch the loss may leave out.

    ``forward`` returns ``(main, side)``: token ids (integers below 10) in,
    a 2-wide main output and a 3-wide side output; leaving ``side`` out of
    the loss leaves its parameters without gradients.
    """

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.l1 = nn.Linear(4, 8)
        self.l2 = nn.Linear(8, 2)
        self.side = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.emb(x)
        return self.l2(torch.tanh(self.l1(h))), self.side(h)


class TPBlock(nn.Module):
    """An MLP block for tensor parallelism: ``up`` splits column-wise, ``down`` row-wise."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.relu(self.up(x)))
        return out


class TPModel(nn.Module):
    """Two :class:`TPBlock` (8 -> 12 and 8 -> 10 hidden) and a plain 8 -> 3 head.

    The second block's 10 hidden rows are 5 per rank on a "tp" axis of 2,
    which a "dp" axis of 2 then splits unevenly (3 + 2).
    """

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([TPBlock(8, 12), TPBlock(8, 10)])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


class CountingAllGather:
    """A custom all-gather that records its allocations and calls, then delegates to gloo/NCCL.

    Tests check that a unit really called the user's object, and with what
    buffer sizes, while the training result stays that of the plain collective.
    """

    def __init__(self) -> None:
        self.allocations: list[tuple[int, ...]] = []
        self.calls = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A fresh buffer of ``size``; its shape is recorded."""
        self.allocations.append(tuple(size))
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        """``all_gather_into_tensor`` of ``input_tensor`` into ``output_tensor``, counted."""
        self.calls += 1
        work: dist.Work | None = dist.all_gather_single(
            output_tensor, input_tensor, group=group, async_op=async_op
        )
        return work


class CountingReduceScatter(CountingAllGather):
    """A custom reduce-scatter that records allocations, calls and reduce ops, then delegates."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __call__(  # type: ignore[override]
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        """``reduce_scatter_tensor`` with ``op``, counted and the op recorded."""
        self.calls += 1
        self.ops.append(str(op))
        work: dist.Work | None = dist.reduce_scatter_single(
            output_tensor, input_tensor, group=group, op=op, async_op=async_op
        )
        return work


@contextlib.contextmanager
def torch_fsdp_collectives() -> Iterator[dict[str, list[bool]]]:
    """Record the all-gathers and reduce-scatters PyTorch's FSDP issues inside the block.

    Yields ``{"all_gather": [...], "reduce_scatter": [...]}``, one ``async_op``
    flag per call, in order. PyTorch's FSDP2 issues them through
    ``torch.distributed.all_gather_single`` / ``reduce_scatter_single``, looked
    up on the module at each call, which this patches for the block (shard's
    own collectives are counted by ``shard_comms.count_collectives``).
    Collectives the model makes itself through those two functions count too.
    """
    seen: dict[str, list[bool]] = {"all_gather": [], "reduce_scatter": []}
    names = {"all_gather": "all_gather_single", "reduce_scatter": "reduce_scatter_single"}
    originals: dict[str, Callable[..., Any]] = {k: getattr(dist, n) for k, n in names.items()}

    def recording(kind: str) -> Callable[..., Any]:
        def call(*args: Any, async_op: bool = False, **kwargs: Any) -> Any:
            seen[kind].append(async_op)
            return originals[kind](*args, async_op=async_op, **kwargs)

        return call

    for kind, name in names.items():
        setattr(dist, name, recording(kind))
    try:
        yield seen
    finally:
        for kind, name in names.items():
            setattr(dist, name, originals[kind])
