"""Simulated world sizes: rank 0 of 8 and 64 ranks in one process, bytes and collectives exact."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shard_comms import CommCounts, count_collectives
from shard_testing.simulate import (
    Frontend,
    Simulation,
    fake_world,
    held_bytes,
    shard_blocks,
    simulate,
)

F32 = 4


class Block(nn.Module):
    """One linear layer: a unit of its own."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim_in, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.tanh(self.lin(x))
        return out


class Net(nn.Module):
    """A 24x16 and a 10x24 block and a 3x10 head on the root: no dim 0 divides by 64."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(16, 24), Block(24, 10)])
        self.head = nn.Linear(10, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


SHAPES = {"a": ((24, 16), (24,)), "b": ((10, 24), (10,)), "root": ((3, 10),)}


def _run(world: int, frontend: Frontend, *, fake_tensors: bool = False) -> Simulation:
    def build(mesh: object) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = Net()
        model = shard_blocks(net, list(net.blocks), mesh=mesh, frontend=frontend)  # type: ignore[arg-type]
        return model, torch.optim.AdamW(model.parameters())

    return simulate(
        build,
        lambda: torch.ones(2, 16),
        world_size=world,
        steps=2,
        fake_tensors=fake_tensors,
        measure=count_collectives,
    )


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _dim0(shape: tuple[int, ...], world: int, rank: int = 0) -> tuple[int, int]:
    """(padded elements per rank, elements rank ``rank`` owns) of a dim-0 shard."""
    rows = _ceil(shape[0], world)
    row = 1 if len(shape) == 1 else shape[1]
    owned = max(0, min(rows, shape[0] - rank * rows))
    return rows * row, owned * row


def _flat(shape: tuple[int, ...], world: int) -> tuple[int, int]:
    """The same for a parameter sharded on its flattened storage (rank 0)."""
    numel = shape[0] * (shape[1] if len(shape) > 1 else 1)
    if len(shape) < 2 or shape[0] % world == 0:
        return _dim0(shape, world)
    per = _ceil(numel, world)
    return per, min(per, numel)


def test_fake_world_is_rank_zero_of_n_and_leaves_nothing_behind() -> None:
    """Inside: a default group of 64 ranks and a 64-rank mesh; after: no process group."""
    with fake_world(64) as mesh:
        assert (dist.get_world_size(), dist.get_rank(), mesh.size()) == (64, 0, 64)
        with (
            pytest.raises(RuntimeError, match="a default process group already exists"),
            fake_world(8),
        ):
            pass
    assert not dist.is_initialized()


def test_fake_world_refuses_a_rank_outside_the_world() -> None:
    """A rank that is not a rank of the world is an error naming both."""
    with (
        pytest.raises(ValueError, match="rank 8 is not a rank of a world of 8"),
        fake_world(8, rank=8),
    ):
        pass


@pytest.mark.parametrize("world", [8, 64])
@pytest.mark.parametrize("frontend", ["fully_shard", "fully_shard_flat"])
def test_fully_shard_state_per_rank_is_the_arithmetic(world: int, frontend: Frontend) -> None:
    """Rank 0's parameters, gradients and AdamW state are exactly ceil(./N) by hand."""
    split = _flat if frontend == "fully_shard_flat" else _dim0
    shapes = [s for unit in SHAPES.values() for s in unit]
    padded = sum(split(s, world)[0] for s in shapes)
    owned = sum(split(s, world)[1] for s in shapes)
    state = _run(world, frontend).state
    assert (state.params, state.grads) == (padded * F32, padded * F32)
    # exp_avg and exp_avg_sq of the local (unpadded) shard, and a 4-byte step, per parameter
    assert state.optim == 2 * owned * F32 + len(shapes) * F32


def test_the_flat_layout_holds_less_than_dim_0_at_64_ranks() -> None:
    """At 64 ranks dim 0 pads each matrix to a whole row per rank; flat pads < 1 element."""
    dim0 = _run(64, "fully_shard").state
    flat = _run(64, "fully_shard_flat").state
    assert (dim0.params, flat.params) == ((16 + 1 + 24 + 1 + 10) * F32, (6 + 1 + 4 + 1 + 1) * F32)


@pytest.mark.parametrize("world", [8, 64])
@pytest.mark.parametrize("frontend", ["fully_shard", "wrapper"])
def test_collectives_per_step_are_exact(world: int, frontend: Frontend) -> None:
    """Per step: forward gathers every unit, backward again all but the root, one reduction each.

    Bytes are the unsharded buffers: N * the padded shard of each unit. The
    process group sees the same gathers; the reduce-scatters run as
    all-reduces of the same buffers on CPU (shard_comms' gloo path).
    """
    sim = _run(world, frontend)
    if frontend == "wrapper":
        unit = {
            name: world * _ceil(sum(_n(s) for s in shapes), world)
            for name, shapes in SHAPES.items()
        }
    else:
        unit = {
            name: world * sum(_dim0(s, world)[0] for s in shapes) for name, shapes in SHAPES.items()
        }
    gathered = (2 * (unit["a"] + unit["b"]) + unit["root"]) * F32
    reduced = (unit["a"] + unit["b"] + unit["root"]) * F32
    for counts in sim.extra:
        assert isinstance(counts, CommCounts)
        assert counts.as_dict() == {
            "all_gather": {"calls": 5, "bytes": gathered},
            "reduce_scatter": {"calls": 3, "bytes": reduced},
            "all_reduce": {"calls": 0, "bytes": 0},
            "broadcast": {"calls": 0, "bytes": 0},
        }
    # The first step also carries the engine's set-up exchange, which shard does not count as
    # a step's collective: every rank's model digest (3 words, length, flag: 5 int64s).
    digests = world * 5 * 8
    assert [(s.calls, s.bytes) for s in sim.steps] == [
        (
            {"all_gather": 6, "all_reduce": 3},
            {"all_gather": gathered + digests, "all_reduce": reduced},
        ),
        ({"all_gather": 5, "all_reduce": 3}, {"all_gather": gathered, "all_reduce": reduced}),
    ]


def _n(shape: tuple[int, ...]) -> int:
    return shape[0] * (shape[1] if len(shape) > 1 else 1)


@pytest.mark.parametrize("frontend", ["fully_shard", "fully_shard_flat", "wrapper"])
def test_fake_tensors_hold_what_real_tensors_hold(frontend: Frontend) -> None:
    """Under FakeTensorMode (no storage) the bytes and collectives are those of a real run."""
    real = _run(64, frontend)
    fake = _run(64, frontend, fake_tensors=True)
    assert fake.state == real.state
    assert [c.as_dict() for c in fake.extra] == [c.as_dict() for c in real.extra]
    # the first step's set-up digest exchange is off under fake tensors; later steps match
    assert [s.bytes for s in fake.steps[1:]] == [s.bytes for s in real.steps[1:]]
    assert real.steps[0].bytes["all_gather"] - fake.steps[0].bytes["all_gather"] == 64 * 5 * 8


def test_held_bytes_counts_a_shared_storage_once_on_any_device() -> None:
    """Two views of one storage count once, and meta tensors count by their storage size."""
    base = torch.zeros(10)
    meta = torch.empty(7, device="meta")
    assert held_bytes([base[:3], base[5:], meta, meta.view(7, 1)]) == 40 + 28


def test_shard_blocks_names_the_frontends_it_knows() -> None:
    """An unknown front end is an error listing the three."""
    with (
        fake_world(2) as mesh,
        pytest.raises(ValueError, match="'fully_shard', 'fully_shard_flat' or 'wrapper'"),
    ):
        shard_blocks(Net(), [], mesh=mesh, frontend="ddp")  # type: ignore[arg-type]
