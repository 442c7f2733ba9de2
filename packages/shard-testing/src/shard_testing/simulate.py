"""Simulated world sizes: one process plays rank 0 of a world of N, and nothing moves.

What a rank holds and what it sends depend on the world size only through
arithmetic (``ceil(numel / N)``, padding, one collective per unit and
phase), and the engine's own CPU cost per step depends mostly on units
and parameters (and on the padded buffers it copies), not on other ranks.
All three can be observed at 1024 ranks without 1024 processes: the
process joins a process group whose collectives return at once without
touching any data, builds the model, shards it as rank 0 would, and runs
full training steps. The values computed are meaningless
(every all-gather's output is whatever the buffer held), the shapes, bytes,
collective calls and Python work are those of rank 0 of the real job.

[Note: the fake process group]
``torch.testing._internal.distributed.fake_pg`` registers the ``"fake"``
c10d backend: a C++ process group of any size in which every collective
completes immediately, and ``FakeStore``, a store that needs no server.
Both are torch internals (``torch.testing._internal``); :func:`fake_world`
is the one place that touches them, so a torch that moves them breaks one
function. DeviceMesh and DTensor work on it unchanged (a 1-D CPU mesh over
the default group).

[Note: fake tensors for big models]
A GPT-2 XL step with real tensors on one CPU core gathers about 12 GB per
step (and minutes of page faults) to learn nothing about its numbers. Under
``FakeTensorMode`` every tensor is a shape without storage, so construction
and a full step of 1.6 B parameters cost only the Python work. Storages
still exist as objects with sizes, so :func:`held_state` counts what rank 0
holds exactly as on a real run (each storage once). The engine's
same-model check (``SHARD_FINGERPRINT``) reads gathered digests back as
Python ints, which fake tensors cannot do, and compares a world of copies
of one process with itself anyway: :func:`simulate` turns it off for the
duration of a fake-tensor run. shard_comms compares storage addresses to
skip a copy out of a collective's buffer; a fake tensor's address is 0 and
torch warns when it is read, so that warning is silenced for the run (the
copy it skips moves data, not bytes held).

[Note: what is counted]
:class:`CollectiveTally` counts the c10d operators that reach the process
group (``c10d.allgather_`` and friends), below any library: what shard's
own counters (``shard_comms.count_collectives``) say it asked for, seen
from the other side. Bytes follow shard's convention, the unsharded
buffer: an all-gather's output, a reduce-scatter's input, an all-reduce's
or a broadcast's tensor.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from shard_core import StateBytes, state_bytes
from shard_core import held_bytes as _held_bytes

__all__ = [
    "CollectiveTally",
    "Frontend",
    "Simulation",
    "StateBytes",
    "StepRecord",
    "fake_world",
    "held_bytes",
    "held_state",
    "shard_blocks",
    "simulate",
]

_FINGERPRINT_ENV = "SHARD_FINGERPRINT"
# See [Note: fake tensors for big models]
_FAKE_DATA_PTR_WARNING = "Accessing the data pointer of FakeTensor"

Frontend = Literal["fully_shard", "fully_shard_flat", "wrapper"]
"""How :func:`shard_blocks` shards: ``fully_shard`` (per-parameter dim 0),
``fully_shard`` with ``flat_shard_placement``, or ``FullyShardedDataParallel``."""


@contextmanager
def fake_world(world_size: int, *, rank: int = 0) -> Iterator[DeviceMesh]:
    """Join a world of ``world_size`` as ``rank`` over the fake backend; yield a 1-D CPU mesh.

    See [Note: the fake process group]. The default process group is
    destroyed on exit, so several worlds can be simulated one after another
    in the same process.

    Raises:
        RuntimeError: a default process group already exists (a simulated
            world cannot share a process with a real one).
        ValueError: ``rank`` is not a rank of the world.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"fake_world: rank {rank} is not a rank of a world of {world_size}")
    if dist.is_initialized():
        raise RuntimeError(
            "fake_world: a default process group already exists; simulate in a process "
            "of its own (or destroy it first)"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


# c10d operator -> (kind, index of the tensor (list) whose bytes count)
_C10D_OPS: dict[str, tuple[str, int]] = {
    "allgather_": ("all_gather", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "reduce_scatter_": ("reduce_scatter", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0),
}


def _nbytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class CollectiveTally(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's __init_subclass__
    """Calls and bytes of the collectives that reach the process group, per kind.

    See [Note: what is counted]. Use as a context manager around the code
    observed; :attr:`calls` and :attr:`bytes` fill up while it runs.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        packet = func.overloadpacket
        if getattr(packet, "_qualified_op_name", "").startswith("c10d::"):
            kind_index = _C10D_OPS.get(packet.__name__)
            if kind_index is not None:
                kind, index = kind_index
                self.calls[kind] = self.calls.get(kind, 0) + 1
                self.bytes[kind] = self.bytes.get(kind, 0) + _nbytes(args[index])
        return func(*args, **(kwargs or {}))


def held_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``, meta tensors included.

    ``shard_core.held_bytes`` with ``meta=True``: storages are told apart by
    identity, so meta and fake tensors (address 0) count too.
    """
    return _held_bytes(tensors, meta=True)


def held_state(model: nn.Module, optim: torch.optim.Optimizer) -> StateBytes:
    """What ``model``'s parameters, their gradients and ``optim``'s state hold on this rank."""
    return state_bytes(model, optim, meta=True)


@dataclass(frozen=True)
class StepRecord:
    """One simulated training step.

    Attributes:
        cpu_s: Process CPU time of the step (forward, backward, optimizer step).
        wall_s: Its wall time.
        calls: Collectives per kind that reached the process group.
        bytes: Their bytes per kind (see [Note: what is counted]).
    """

    cpu_s: float
    wall_s: float
    calls: dict[str, int]
    bytes: dict[str, int]


@dataclass
class Simulation:
    """What rank 0 of a simulated world did and held.

    Attributes:
        world_size: The simulated number of ranks.
        construct_cpu_s: CPU time of building and sharding the model.
        state: What rank 0 held after the last step.
        steps: Every step, in order (the first includes lazy initialization).
        extra: Whatever ``measure`` returned, by step (see :func:`simulate`).
    """

    world_size: int
    construct_cpu_s: float
    state: StateBytes
    steps: list[StepRecord] = field(default_factory=list)
    extra: list[Any] = field(default_factory=list)

    def median_cpu_s(self, *, skip_first: bool = True) -> float:
        """Median CPU time of a step; the first (lazy init) left out when there are others."""
        times = [s.cpu_s for s in self.steps]
        if skip_first and len(times) > 1:
            times = times[1:]
        times.sort()
        return times[len(times) // 2]


Build = Callable[[DeviceMesh], tuple[nn.Module, torch.optim.Optimizer]]
"""Builds the model sharded over the mesh, and its optimizer, as rank 0 of the world."""


def shard_blocks(
    model: nn.Module, blocks: Sequence[nn.Module], *, mesh: DeviceMesh, frontend: Frontend
) -> nn.Module:
    """Shard ``model`` with shard's ``frontend``, one unit per block and the root last.

    shard-runtime is imported on call (``compat.fsdp_namespace``), so this
    package keeps depending on shard-core only. ``mesh``: the one
    :func:`fake_world` yields (built outside any fake-tensor mode, which
    cannot build one). Returns the module to train (the wrapper's instance,
    or ``model`` itself).
    """
    from shard_testing.compat import fsdp_namespace

    shard = fsdp_namespace("shard")
    if frontend == "wrapper":
        wrapped: nn.Module = shard.FullyShardedDataParallel(
            model,
            auto_wrap_policy=shard.ModuleWrapPolicy({type(b) for b in blocks}),
            device_id=torch.device("cpu"),
            device_mesh=mesh,
        )
        return wrapped
    if frontend not in ("fully_shard", "fully_shard_flat"):
        raise ValueError(
            f"shard_blocks: frontend must be 'fully_shard', 'fully_shard_flat' or 'wrapper', "
            f"got {frontend!r}"
        )
    options: dict[str, Any] = {}
    if frontend == "fully_shard_flat":
        options["shard_placement_fn"] = shard.flat_shard_placement
    for block in blocks:
        shard.fully_shard(block, mesh=mesh, **options)
    shard.fully_shard(model, mesh=mesh, **options)
    return model


def _default_step(
    model: nn.Module, optim: torch.optim.Optimizer, inputs: torch.Tensor
) -> torch.Tensor:
    loss = model(inputs).float().mean()
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=False)
    assert isinstance(loss, torch.Tensor)
    return loss


def simulate(
    build: Build,
    inputs: Callable[[], torch.Tensor],
    *,
    world_size: int,
    steps: int = 3,
    fake_tensors: bool = False,
    step: Callable[[nn.Module, torch.optim.Optimizer, torch.Tensor], object] = _default_step,
    measure: Callable[[], AbstractContextManager[Any]] | None = None,
) -> Simulation:
    """Build, shard and train for ``steps`` steps as rank 0 of ``world_size`` ranks.

    ``build(mesh)`` returns the sharded model and its optimizer (it calls
    ``fully_shard`` or the wrapper itself: this package depends on shard-core
    only). ``inputs()`` is called once per step, inside the fake-tensor mode
    when ``fake_tensors`` is set (see [Note: fake tensors for big models]).
    ``step`` runs one training step (default: mean of the output as the loss,
    backward, ``optim.step()``, ``zero_grad(set_to_none=False)`` so that
    gradients stay allocated and are counted). ``measure``, when given, makes
    a context manager entered around each step (shard's own collective
    counters, say); what its ``__enter__`` returned is kept in
    :attr:`Simulation.extra`.
    """
    with ExitStack() as stack:
        mesh = stack.enter_context(fake_world(world_size))
        if fake_tensors:
            from torch._subclasses.fake_tensor import FakeTensorMode

            previous = os.environ.get(_FINGERPRINT_ENV)
            os.environ[_FINGERPRINT_ENV] = "0"
            stack.callback(_restore_env, _FINGERPRINT_ENV, previous)
            stack.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("ignore", message=_FAKE_DATA_PTR_WARNING)
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        start = time.process_time()
        model, optim = build(mesh)
        result = Simulation(
            world_size=world_size,
            construct_cpu_s=time.process_time() - start,
            state=StateBytes(0, 0, 0),
        )
        for _ in range(steps):
            batch = inputs()
            tally = CollectiveTally()
            with ExitStack() as around:
                if measure is not None:
                    result.extra.append(around.enter_context(measure()))
                around.enter_context(tally)
                cpu, wall = time.process_time(), time.perf_counter()
                step(model, optim, batch)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            result.steps.append(StepRecord(cpu, wall, dict(tally.calls), dict(tally.bytes)))
        result.state = held_state(model, optim)
        del model, optim
    return result


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
