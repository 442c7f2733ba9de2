"""``shard plan``'s bytes per step, with and without ``--comm-quant``, against shard's counters.

The plan's arithmetic must equal what shard's collective counters count in a
training step: on 2 gloo ranks for every strategy and both front ends, and
on rank 0 of 1024 simulated ranks (a fake process group) for ``fully_shard``
and the wrapper.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest
import torch
from torch import nn

from shard_cli import PlanConfig, plan_model_units
from shard_cli._comm_quant import apply_comm_quant, comm_quant_codecs, parse_comm_quant
from shard_cli._plan_comm import CommPerStep, comm_per_step, feedback_bytes
from shard_cli._strategy import shard_layout, shard_model
from shard_cli.gpt import GPT, Block, GPTConfig
from shard_comms import count_collectives
from shard_core import get_registry
from shard_runtime import ModuleWrapPolicy
from shard_runtime._state import states_in
from shard_testing import RankPool

CONFIG = GPTConfig(vocab_size=50, d_model=24, n_heads=4, n_layers=2, seq_len=12)
POLICY = ModuleWrapPolicy({Block})
QUANT = parse_comm_quant("weights,grads=int4")


def _units() -> list[Any]:
    with torch.device("meta"):
        return plan_model_units(GPT(CONFIG), POLICY)


def _codecs(parts: tuple[str, ...]) -> dict[str, Any]:
    return {
        side: get_registry().comm_codec(name) for side, name in comm_quant_codecs(parts).items()
    }


def _counted(
    frontend: str, strategy: str, shard_size: int | None, precision: str
) -> list[dict[str, int]]:
    world = torch.distributed.get_world_size()
    counted = []
    for parts in ((), QUANT):
        torch.manual_seed(0)
        model, _ = shard_model(
            GPT(CONFIG),
            frontend=frontend,  # type: ignore[arg-type]
            strategy=strategy,  # type: ignore[arg-type]
            layout=shard_layout(strategy, world, shard_size),  # type: ignore[arg-type]
            precision=precision,  # type: ignore[arg-type]
            cpu_offload=False,
            policy=POLICY,
            device=torch.device("cpu"),
        )
        apply_comm_quant(model, parts)
        tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len))
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
        with autocast:  # the first step initializes; the second is counted
            model(tokens).float().sum().backward()  # type: ignore[no-untyped-call]
        with count_collectives() as counts, autocast:
            model(tokens).float().sum().backward()  # type: ignore[no-untyped-call]
        counted.append({k: counts.bytes(k) for k in ("all_gather", "reduce_scatter", "all_reduce")})
    kept = sum(unit.feedback_nbytes for state in states_in([model]) for unit in state.units)
    return [*counted, {"feedback": kept}]


@pytest.mark.parametrize(
    ("frontend", "strategy", "shard_size", "precision"),
    [
        ("fully_shard", "full", None, "fp32"),
        ("fully_shard", "grad-op", None, "bf16"),
        ("fully_shard", "no-shard", None, "fp32"),
        ("wrapper", "full", None, "fp32"),
        ("wrapper", "hybrid", 1, "fp32"),
    ],
)
def test_plan_counts_what_two_ranks_count(
    rank_pool: RankPool, frontend: str, strategy: str, shard_size: int | None, precision: str
) -> None:
    """A step's counted bytes equal the plan's, plain and quantized, on every rank; so do
    the error-feedback residuals the units keep."""
    results = rank_pool.run(_counted, 2, frontend, strategy, shard_size, precision)
    config: Any = PlanConfig(
        frontend=frontend,  # type: ignore[arg-type]
        strategy=strategy,  # type: ignore[arg-type]
        world=2,
        shard_size=shard_size,
        precision=precision,  # type: ignore[arg-type]
    )
    plain = asdict(comm_per_step(_units(), config))
    quantized = asdict(comm_per_step(_units(), config, _codecs(QUANT)))
    kept = {"feedback": feedback_bytes(_units(), config)}
    for counted in results:
        assert counted == [plain, quantized, kept]
    assert sum(quantized.values()) < 0.3 * sum(plain.values())


@pytest.mark.parametrize("frontend", ["fully_shard", "wrapper"])
def test_plan_counts_what_rank_zero_of_1024_counts(frontend: str) -> None:
    """Rank 0 of 1024 simulated ranks counts the plan's quantized bytes in a step.

    (No ratio here: this GPT's rows over 1024 ranks are a few dozen values,
    so a block of 256 is mostly padding; ``tools/bench/simulate.py`` shows
    GPT-2 XL's.)
    """
    from shard_testing.simulate import shard_blocks, simulate

    def build(mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = GPT(CONFIG)
        model = shard_blocks(net, list(net.blocks), mesh=mesh, frontend=frontend)  # type: ignore[arg-type]
        apply_comm_quant(model, QUANT)
        return model, torch.optim.AdamW(model.parameters())

    sim = simulate(
        build,
        lambda: torch.randint(0, CONFIG.vocab_size, (1, CONFIG.seq_len)),
        world_size=1024,
        steps=2,
        measure=count_collectives,
    )
    counts = sim.extra[-1]
    config: Any = PlanConfig(frontend=frontend, world=1024)  # type: ignore[arg-type]
    planned = comm_per_step(_units(), config, _codecs(QUANT))
    counted = CommPerStep(
        all_gather=counts.bytes("all_gather"),
        reduce_scatter=counts.bytes("reduce_scatter"),
        all_reduce=counts.bytes("all_reduce"),
    )
    assert counted == planned
