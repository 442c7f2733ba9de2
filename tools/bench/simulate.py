"""Simulated world sizes: what rank 0 holds, sends and spends at 8 to 1024 ranks, in one process.

Why: the claims "each rank holds 1/N", "two all-gathers and one
reduce-scatter per unit per step" and "the engine's Python cost does not grow
with the world" are about world sizes this machine cannot launch. Rank 0's
view of them needs no other rank: ``shard_testing.simulate`` joins a fake
process group of N ranks (collectives return at once, nothing moves) and
runs shard's ``fully_shard`` and ``FullyShardedDataParallel`` through
construction and full training steps. Run from the repository root::

    .venv/bin/python tools/bench/simulate.py [--worlds 8 64 256 1024] [--json OUT]

[Note: what the tables are]
- state: GPT-2 XL's shapes (1.6 B parameters, 48 blocks, each block a unit,
  the root last), built and trained for one step under ``FakeTensorMode``
  (shapes without storage; see ``shard_testing.simulate``). ``state/rank``
  is the bytes of the storages behind rank 0's parameters, their gradients
  and AdamW's state after the step, padding included, each storage once;
  ``plan`` is ``shard plan``'s arithmetic for the same configuration and
  must be equal (``=``). ``ideal`` is one process's state divided by N;
  ``ratio`` is state/rank over ideal, for ``fully_shard``'s default dim-0
  layout, ``flat_shard_placement`` and the wrapper. ``colls/step`` and
  ``bytes/step`` are shard's own collective counters for the step
  (``shard_comms.count_collectives``: all-gathers + reduce-scatters; bytes of
  the unsharded buffers), and ``pg calls`` what reached the process group
  (on CPU, reduce-scatters go as all-reduces of the same buffers, and the
  engine's first step adds its one set-up exchange, the model digest, kept
  out of shard's counters). On CPU shard_comms also splits all-gathers
  above 16 MiB into chunks for gloo (one counted collective, several
  process-group calls); under fake tensors that split costs most of a
  step's Python time and says nothing about the engine, so this script
  turns it off for the state table (``_CHUNKED_GATHER_DEVICES``).
- engine: a small real-valued GPT (width 64, the given block counts) trained
  for a few steps with real tensors on the fake process group. ``step ms`` is
  the median CPU time (``time.process_time``) of a step after the first;
  ``plain ms`` the same model unsharded in the same process; ``engine ms``
  the difference: what sharding costs in Python and copies when
  communication is free. The first table varies the world at a fixed block
  count, the second the block count (units) at a fixed world.
- peak: the same small model's step traced by ``torch.profiler`` (shard
  train's ``profile_step``), against ``shard plan``'s estimated peak for the
  same batch. A fake process group allocates no staging buffers, and plan
  counts none on CPU either.
- quantized communication (``--comm-quant weights,grads``, off by default):
  GPT-2 XL's shapes again, each unit's communication quantized as ``shard
  train --comm-quant`` does (shard-comm-quant's codecs run on the fake
  tensors), one step after the first; the bytes shard's counters count per
  kind against ``shard plan --comm-quant``'s arithmetic (``=``) and against
  the same step without quantization.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from multiprocessing import get_context
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shard_cli._activations import lm_activation_profile
from shard_cli._comm_quant import apply_comm_quant, comm_quant_codecs, parse_comm_quant
from shard_cli._measure import StepTrace, profile_step
from shard_cli._plan import PlanConfig, estimate_memory, plan_model_units, unsharded_memory
from shard_cli._plan_comm import comm_per_step
from shard_cli.gpt import GPT, Block, GPTConfig
from shard_comms import _collectives, count_collectives
from shard_core import get_registry, held_bytes
from shard_runtime import ModuleWrapPolicy
from shard_testing.simulate import Frontend, shard_blocks, simulate

XL = GPTConfig(vocab_size=50257, d_model=1600, n_heads=25, n_layers=48, seq_len=1024)
SMALL = dict(vocab_size=96, d_model=64, n_heads=4, seq_len=32)
LAYOUTS: tuple[Frontend, ...] = ("fully_shard", "fully_shard_flat", "wrapper")


def _plan_state(config: GPTConfig, frontend: Frontend, world: int) -> dict[str, int]:
    with torch.device("meta"):
        model = GPT(config)
    units = plan_model_units(model, ModuleWrapPolicy({Block}))
    estimate = estimate_memory(
        units,
        PlanConfig(
            frontend="wrapper" if frontend == "wrapper" else "fully_shard",
            world=world,
            flat=frontend == "fully_shard_flat",
        ),
    )
    ideal = unsharded_memory(units).state / world
    return {
        "params": estimate.params,
        "grads": estimate.grads,
        "optim": estimate.optim,
        "state": estimate.state,
        "ideal": round(ideal),
    }


def _builder(
    config: GPTConfig, frontend: Frontend | None
) -> Callable[[Any], tuple[nn.Module, torch.optim.Optimizer]]:
    def build(mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model: nn.Module = GPT(config)
        if frontend is not None:
            model = shard_blocks(model, list(model.blocks), mesh=mesh, frontend=frontend)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    return build


def state_task(world: int, frontend: Frontend, layers: int) -> dict[str, Any]:
    """One world size and layout of GPT-2 XL's shapes, simulated with fake tensors."""
    torch.set_num_threads(1)
    # See [Note: what the tables are]: gloo's chunked all-gather, off for the fake-tensor run.
    _collectives._CHUNKED_GATHER_DEVICES = frozenset()
    config = GPTConfig(**{**XL.__dict__, "n_layers": layers})
    sim = simulate(
        _builder(config, frontend),
        lambda: torch.randint(0, config.vocab_size, (1, 8)),
        world_size=world,
        steps=1,
        fake_tensors=True,
        measure=count_collectives,
    )
    counts = sim.extra[-1]
    step = sim.steps[-1]
    return {
        "world": world,
        "frontend": frontend,
        "state": {"params": sim.state.params, "grads": sim.state.grads, "optim": sim.state.optim},
        "plan": _plan_state(config, frontend, world),
        "calls": {k: counts.calls(k) for k in ("all_gather", "reduce_scatter", "all_reduce")},
        "bytes": counts.bytes(),
        "pg_calls": sum(step.calls.values()),
        "pg_bytes": sum(step.bytes.values()),
        "construct_cpu_s": sim.construct_cpu_s,
        "step_cpu_s": step.cpu_s,
    }


def comm_task(world: int, frontend: Frontend, layers: int, comm_quant: str) -> dict[str, Any]:
    """GPT-2 XL's shapes with quantized communication: counted bytes of a step against the plan."""
    torch.set_num_threads(1)
    _collectives._CHUNKED_GATHER_DEVICES = frozenset()  # see [Note: what the tables are]
    parts = parse_comm_quant(comm_quant)
    config = GPTConfig(**{**XL.__dict__, "n_layers": layers})

    def build(mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
        model, optim = _builder(config, frontend)(mesh)
        apply_comm_quant(model, parts)
        return model, optim

    sim = simulate(
        build,
        lambda: torch.randint(0, config.vocab_size, (1, 8)),
        world_size=world,
        steps=2,
        fake_tensors=True,
        measure=count_collectives,
    )
    counts = sim.extra[-1]
    with torch.device("meta"):
        units = plan_model_units(GPT(config), ModuleWrapPolicy({Block}))
    codecs = {s: get_registry().comm_codec(n) for s, n in comm_quant_codecs(parts).items()}
    plan_config = PlanConfig(
        frontend="wrapper" if frontend == "wrapper" else "fully_shard", world=world
    )
    kinds = ("all_gather", "reduce_scatter", "all_reduce")
    return {
        "world": world,
        "frontend": frontend,
        "comm_quant": list(parts),
        "counted": {k: counts.bytes(k) for k in kinds},  # type: ignore[arg-type]
        "plan": asdict(comm_per_step(units, plan_config, codecs)),
        "plan_plain": asdict(comm_per_step(units, plan_config)),
    }


def engine_task(world: int, layers: int, steps: int, frontend: Frontend | None) -> dict[str, Any]:
    """CPU time per step of the small GPT with real tensors (``frontend=None``: unsharded)."""
    torch.set_num_threads(1)  # process_time counts every thread; idle spinning ones too
    config = GPTConfig(**SMALL, n_layers=layers)  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(0)
    sim = simulate(
        _builder(config, frontend),
        lambda: torch.randint(0, config.vocab_size, (4, config.seq_len), generator=generator),
        world_size=world,
        steps=steps,
    )
    return {
        "world": world,
        "layers": layers,
        "frontend": frontend or "plain",
        "step_ms": 1000 * sim.median_cpu_s(),
        "collectives": sum(sim.steps[-1].calls.values()),
    }


PEAK_BATCH = 8


def peak_task(world: int, layers: int, frontend: Frontend) -> dict[str, Any]:
    """The small GPT's measured step peak (real tensors, fake group) against plan's estimate."""
    torch.set_num_threads(1)
    config = GPTConfig(**SMALL, n_layers=layers)  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(0)
    traces: list[StepTrace] = []

    def step(model: nn.Module, optim: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
        # shard train's step: cross-entropy on next tokens, gradients freed before the step
        optim.zero_grad(set_to_none=True)
        params = [*model.parameters()]
        states = [v for st in optim.state.values() for v in st.values() if torch.is_tensor(v)]
        with profile_step(torch.device("cpu"), held_bytes([*params, *states])) as trace:
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(
                logits.float().reshape(-1, config.vocab_size), tokens[:, 1:].reshape(-1)
            )
            loss.backward()
            optim.step()
        traces.append(trace)

    simulate(
        _builder(config, frontend),
        lambda: torch.randint(
            0, config.vocab_size, (PEAK_BATCH, config.seq_len + 1), generator=generator
        ),
        world_size=world,
        steps=4,
        step=step,
    )
    with torch.device("meta"):
        model = GPT(config)
    units = plan_model_units(model, ModuleWrapPolicy({Block}))
    activations = lm_activation_profile(
        lambda: GPT(config),
        [u.name for u in units],
        batch=PEAK_BATCH,
        seq=config.seq_len,
        vocab_size=config.vocab_size,
    )
    estimate = estimate_memory(
        units,
        PlanConfig(frontend="wrapper" if frontend == "wrapper" else "fully_shard", world=world),
        activations=activations,
    )
    measured = min(t.peak_bytes for t in traces[1:])
    return {
        "world": world,
        "frontend": frontend,
        "measured_peak": measured,
        "plan_peak": estimate.peak,
        "ratio": measured / estimate.peak,
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def _plan_agrees(row: dict[str, Any]) -> bool:
    """Whether plan's parameters, gradients and AdamW bytes are exactly the simulated ones."""
    return all(row["state"][k] == row["plan"][k] for k in ("params", "grads", "optim"))


def _print_state(
    rows: list[dict[str, Any]], engine: dict[tuple[int, str], float], layers: int
) -> None:
    by = {(r["world"], r["frontend"]): r for r in rows}
    worlds = sorted({r["world"] for r in rows})
    print(
        f"\nGPT-2 XL shapes ({layers} blocks + root = {layers + 1} units), rank 0, AdamW, fp32; "
        "fully_shard dim-0 unless said\n"
        f"{'world':>6} {'state/rank MiB':>15} {'plan':>5} {'ideal MiB':>10} {'ratio dim-0':>12} "
        f"{'ratio flat':>11} {'ratio wrapper':>14} {'colls/step':>11} {'GiB/step':>9} "
        f"{'flat GiB/step':>14} "
        f"{'pg calls':>9} {'engine ms/step*':>15}"
    )
    for w in worlds:
        d, f, wr = by[(w, "fully_shard")], by[(w, "fully_shard_flat")], by[(w, "wrapper")]
        same = all(_plan_agrees(x) for x in (d, f, wr))
        ideal = d["plan"]["ideal"]
        ratios = [sum(x["state"].values()) / ideal for x in (d, f, wr)]
        colls = d["calls"]["all_gather"] + d["calls"]["reduce_scatter"]
        eng = engine.get((w, "fully_shard"))
        print(
            f"{w:>6} {_mib(sum(d['state'].values())):>15} {'=' if same else 'DIFF':>5} "
            f"{_mib(ideal):>10} {ratios[0]:>11.4f}x {ratios[1]:>10.4f}x {ratios[2]:>13.4f}x "
            f"{colls:>11} {d['bytes'] / 2**30:>9.2f} {f['bytes'] / 2**30:>14.2f} "
            f"{d['pg_calls']:>9} "
            f"{eng if eng is None else f'{eng:.1f}':>15}"
        )


def _print_comm(rows: list[dict[str, Any]], layers: int) -> None:
    parts = ",".join(rows[0]["comm_quant"]) if rows else ""
    print(
        f"\nGPT-2 XL shapes ({layers} blocks + root), rank 0, fp32, --comm-quant {parts}: "
        "bytes per step counted by shard against shard plan\n"
        f"{'world':>6} {'frontend':>12} {'all-gather MiB':>15} {'reduce-sc. MiB':>15} "
        f"{'plan':>5} {'GiB/step':>9} {'fp32 GiB/step':>14} {'ratio':>7}"
    )
    for r in rows:
        counted, plain = r["counted"], r["plan_plain"]
        total, fp32 = sum(counted.values()), sum(plain.values())
        print(
            f"{r['world']:>6} {r['frontend']:>12} {_mib(counted['all_gather']):>15} "
            f"{_mib(counted['reduce_scatter']):>15} "
            f"{'=' if counted == r['plan'] else 'DIFF':>5} {total / 2**30:>9.3f} "
            f"{fp32 / 2**30:>14.3f} {total / fp32:>6.3f}x"
        )


def main(argv: list[str] | None = None) -> int:
    """Run the simulations and print the tables; the exit status (1: plan disagreed)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--layers", type=int, default=48, help="GPT-2 XL blocks (default 48)")
    parser.add_argument("--units-world", type=int, default=64, help="world of the units table")
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--engine-layers", type=int, default=8, help="blocks of the world table")
    parser.add_argument("--steps", type=int, default=6, help="engine steps (first is dropped)")
    parser.add_argument("--jobs", type=int, default=2, help="processes for the state table")
    parser.add_argument(
        "--comm-quant",
        default="",
        help="also simulate GPT-2 XL with quantized communication (shard train --comm-quant "
        "syntax, e.g. weights,grads) and check shard plan's bytes per step",
    )
    parser.add_argument("--json", help="write every figure as JSON to this file")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    ctx = get_context("spawn")
    with ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        futures = [pool.submit(state_task, w, f, args.layers) for w in args.worlds for f in LAYOUTS]
        states = [f.result() for f in futures]
    engine_rows: list[dict[str, Any]] = []
    # one process at a time: timings are not taken next to a busy sibling
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
        jobs = [(w, args.engine_layers) for w in args.worlds]
        jobs += [(args.units_world, b) for b in args.blocks if b != args.engine_layers]
        for world, layers in jobs:
            for frontend in (None, "fully_shard", "wrapper"):
                engine_rows.append(
                    pool.submit(engine_task, world, layers, args.steps, frontend).result()
                )
        peaks = [
            pool.submit(peak_task, w, args.engine_layers, f).result()
            for w in args.worlds
            for f in ("fully_shard", "wrapper")
        ]
    ms = {(r["world"], r["layers"], r["frontend"]): r["step_ms"] for r in engine_rows}

    def engine_ms(world: int, layers: int, frontend: str) -> float:
        return ms[(world, layers, frontend)] - ms[(world, layers, "plain")]

    _print_state(
        states,
        {(w, "fully_shard"): engine_ms(w, args.engine_layers, "fully_shard") for w in args.worlds},
        args.layers,
    )
    print(f"* of the small GPT ({args.engine_layers} blocks), below")
    print(
        f"\nengine CPU ms/step (small GPT, width 64, batch 4 x 32; step - unsharded step), "
        f"{args.engine_layers} blocks"
    )
    print(f"{'world':>6} {'plain ms':>9} {'fully_shard':>12} {'wrapper':>9}")
    for w in args.worlds:
        print(
            f"{w:>6} {ms[(w, args.engine_layers, 'plain')]:>9.1f} "
            f"{engine_ms(w, args.engine_layers, 'fully_shard'):>12.1f} "
            f"{engine_ms(w, args.engine_layers, 'wrapper'):>9.1f}"
        )
    print(f"\nengine CPU ms/step against units, world {args.units_world}")
    print(f"{'blocks':>6} {'plain ms':>9} {'fully_shard':>12} {'wrapper':>9} {'per unit fs':>12}")
    for b in sorted(set(args.blocks) | {args.engine_layers}):
        if (args.units_world, b, "plain") not in ms:
            continue
        fs = engine_ms(args.units_world, b, "fully_shard")
        print(
            f"{b:>6} {ms[(args.units_world, b, 'plain')]:>9.1f} {fs:>12.1f} "
            f"{engine_ms(args.units_world, b, 'wrapper'):>9.1f} {fs / (b + 1):>12.2f}"
        )
    print(
        f"\nstep peak, small GPT ({args.engine_layers} blocks, batch {PEAK_BATCH} x 32), "
        "measured (torch.profiler) against shard plan"
    )
    print(
        f"{'world':>6} {'frontend':>12} {'measured MiB':>13} {'plan MiB':>9} {'measured/plan':>14}"
    )
    for r in peaks:
        print(
            f"{r['world']:>6} {r['frontend']:>12} {_mib(r['measured_peak']):>13} "
            f"{_mib(r['plan_peak']):>9} {r['ratio']:>14.3f}"
        )
    agree = all(_plan_agrees(r) for r in states)
    comm_rows: list[dict[str, Any]] = []
    if args.comm_quant:
        with ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
            futures = [
                pool.submit(comm_task, w, f, args.layers, args.comm_quant)
                for w in args.worlds
                for f in ("fully_shard", "wrapper")
            ]
            comm_rows = [f.result() for f in futures]
        _print_comm(comm_rows, args.layers)
        agree = agree and all(r["counted"] == r["plan"] for r in comm_rows)

    print(
        f"\nshard plan {'agrees exactly' if agree else 'DISAGREES'} on state bytes at every size; "
        f"{time.perf_counter() - start:.0f} s"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(
                {"state": states, "engine": engine_rows, "peak": peaks, "comm": comm_rows},
                out,
                indent=2,
            )
    return 0 if agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
