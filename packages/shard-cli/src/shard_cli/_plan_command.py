"""``shard plan``: will it fit, before launching anything.

The model comes from a preset, a ``module:factory`` import path, or a Hugging
Face ``transformers`` config (a local ``config.json`` or a config class name
with keyword arguments; nothing is downloaded), always built on the meta
device by ``_model_source.py`` (shared with ``shard train``). The wrap plan
is printed as a tree of units, then per-rank memory for each strategy side
by side; all of it is arithmetic (see ``_plan.py``). The flags are in
``_plan_parser.py``, which imports this module only to run the command.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch

from shard_cli._activations import ActivationProfile, lm_activation_profile
from shard_cli._blocks import checkpointed_blocks
from shard_cli._comm_quant import comm_quant_codecs, parse_comm_quant
from shard_cli._finetune import Finetuning, finetuned_source
from shard_cli._format import format_bytes
from shard_cli._model_source import ModelSource, load_model_source, parse_key_values
from shard_cli._options import (
    STRATEGIES,
    Frontend,
    Precision,
    Strategy,
    check_finetuning_flags,
    normalise_names,
)
from shard_cli._plan import (
    MemoryEstimate,
    PlanConfig,
    UnitPlan,
    estimate_memory,
    plan_model_units,
    unsharded_memory,
)
from shard_cli._plan_comm import comm_per_step, feedback_bytes
from shard_cli._strategy import compute_dtype, resolve_policy
from shard_core import get_registry
from shard_core.errors import ShardError

__all__ = ["format_plan", "layout_comparison", "plan_report", "run_plan"]


# ---------------------------------------------------------------------- report


def _tree_lines(units: Sequence[UnitPlan], dtype_bytes: int) -> list[str]:
    """The units as an indented tree; runs of identical siblings on one line."""
    names = [u.name for u in units]

    def parent(name: str) -> str | None:
        best: str | None = None
        for other in names:
            inside = other != name and (other == "" or name.startswith(other + "."))
            if inside and (best is None or len(other) > len(best)):
                best = other
        return best

    children: dict[str | None, list[UnitPlan]] = {}
    for unit in units:
        children.setdefault(parent(unit.name) if unit.name else None, []).append(unit)
    lines: list[str] = []

    def show(unit: UnitPlan, depth: int, count: int, last_name: str) -> None:
        label = unit.name or "(root)"
        if count > 1:
            label = f"{unit.name} .. {last_name} ({count}x)"
        own = ", ".join(p.name for p in unit.params[:4])
        if len(unit.params) > 4:
            own += ", ..."
        each = " each" if count > 1 else ""
        lines.append(
            f"  {'  ' * depth}{label} [{unit.module_type}]  {unit.numel / 1e6:.3f} M params{each}, "
            f"{format_bytes(unit.numel * dtype_bytes)}{each}"
            + (f"  ({own})" if not unit.name else "")
        )

    def walk(unit: UnitPlan, depth: int) -> None:
        kids = sorted(children.get(unit.name, []), key=lambda u: names.index(u.name))
        i = 0
        while i < len(kids):
            j = i
            while (
                j + 1 < len(kids)
                and kids[j + 1].module_type == kids[i].module_type
                and kids[j + 1].numel == kids[i].numel
                and not children.get(kids[j + 1].name)
            ):
                j += 1
            show(kids[i], depth, j - i + 1, kids[j].name)
            if j == i:
                walk(kids[i], depth + 1)
            i = j + 1

    root = units[-1]
    show(root, 0, 1, "")
    walk(root, 1)
    return lines


def _default_shard_size(world: int) -> int:
    return 8 if world % 8 == 0 and world > 8 else world


def plan_report(
    source: ModelSource,
    *,
    world: int,
    strategies: Sequence[Strategy],
    frontend: Frontend,
    precision: Precision,
    cpu_offload: bool,
    wrap_policy: str,
    shard_size: int | None,
    wrap_options: Mapping[str, Any] | None = None,
    batch: int | None,
    seq: int | None,
    rank: int,
    flat: bool = False,
    activation_checkpointing: bool = False,
    comm_quant: Sequence[str] = (),
) -> dict[str, Any]:
    """Everything ``shard plan`` prints, as a JSON-able dict (see :func:`format_plan`).

    ``activation_checkpointing``: the blocks ``shard train --activation-checkpointing``
    recomputes keep only their inputs from forward to backward. ``comm_quant``:
    the parts ``--comm-quant`` quantizes (``("weights=int8", "grads=int8")``);
    the bytes per step are shown with and without them.
    """
    quant = parse_comm_quant(tuple(comm_quant))
    codecs = {
        side: get_registry().comm_codec(name) for side, name in comm_quant_codecs(quant).items()
    }
    policy_name = source.default_policy if wrap_policy == "auto" else wrap_policy
    with torch.device("meta"):
        model = source.build()
    units = plan_model_units(model, resolve_policy(policy_name, wrap_options or {}))
    checkpointed = checkpointed_blocks(model, source) if activation_checkpointing else []
    batch = batch or source.batch
    seq = seq or source.seq
    activations: ActivationProfile | None = None
    single: ActivationProfile | None = None
    note = ""
    if source.vocab_size is not None and batch and seq:
        names = [u.name for u in units]
        vocab = source.vocab_size
        try:
            activations = lm_activation_profile(
                source.build,
                names,
                batch=batch,
                seq=seq,
                vocab_size=vocab,
                dtype=compute_dtype(precision),
                logits_of=source.logits_of,
            )
            single = (
                activations
                if precision == "fp32"
                else lm_activation_profile(
                    source.build,
                    names,
                    batch=batch,
                    seq=seq,
                    vocab_size=vocab,
                    logits_of=source.logits_of,
                )
            )
        except Exception as exc:  # a model the fake forward cannot run
            note = (
                f"activations not estimated: the fake forward failed ({type(exc).__name__}: {exc})"
            )
    else:
        note = "activations not estimated: no example input for this model (add them yourself)"
    hybrid = shard_size or _default_shard_size(world)
    # Frozen parameters (--lora, --freeze): the wrapper keeps the originals (use_orig_params).
    frozen = any(u.frozen for u in units)
    columns: dict[str, MemoryEstimate] = {}
    comm: dict[str, dict[str, Any]] = {}
    for strategy in strategies:
        config = PlanConfig(
            frontend=frontend,
            strategy=strategy,
            world=world,
            shard_size=hybrid if strategy == "hybrid" else None,
            precision=precision,
            cpu_offload=cpu_offload,
            flat=flat,
            orig_params=frozen,
        )
        columns[strategy] = estimate_memory(
            units, config, activations=activations, rank=rank, checkpointed=checkpointed
        )
        comm[strategy] = {"plain": asdict(comm_per_step(units, config))}
        if codecs:
            comm[strategy]["quantized"] = asdict(comm_per_step(units, config, codecs))
            if "grads" in codecs:
                comm[strategy]["feedback_bytes"] = feedback_bytes(units, config)
    alone = unsharded_memory(units, activations=single, checkpointed=checkpointed)
    layouts = layout_comparison(units, world=world, precision=precision, rank=rank)
    return {
        "model": source.description,
        "parameters": sum(u.numel for u in units),
        "trainable": sum(p.numel for u in units for p in u.trainable),
        "wrap_policy": policy_name,
        "wrap_options": dict(wrap_options or {}),
        "frontend": frontend,
        "precision": precision,
        "cpu_offload": cpu_offload,
        "world_size": world,
        "rank": rank,
        "flat": flat,
        "activation_checkpointing": activation_checkpointing,
        "hybrid_shard_size": hybrid,
        "batch": batch if activations else None,
        "seq": seq if activations else None,
        "note": note,
        "units": [
            {
                "name": u.name,
                "module_type": u.module_type,
                "numel": u.numel,
                "bytes": u.numel * u.element_size,
                "params": [p.name for p in u.params],
            }
            for u in units
        ],
        "tree": _tree_lines(units, units[-1].element_size if units else 4),
        "strategies": {
            name: {k: v for k, v in asdict(e).items() if k != "config"}
            for name, e in columns.items()
        },
        "unsharded": {k: v for k, v in asdict(alone).items() if k != "config"},
        "layouts": layouts,
        "comm_quant": list(quant),
        "comm_per_step": comm,
    }


_LAYOUTS: tuple[tuple[str, Frontend, bool], ...] = (
    ("dim-0", "fully_shard", False),
    ("flat", "fully_shard", True),
    ("wrapper", "wrapper", False),
)
"""The per-rank layouts compared: ``fully_shard``'s default, with
``flat_shard_placement``, and the wrapper's flat units."""


def layout_comparison(
    units: Sequence[UnitPlan], *, world: int, precision: Precision = "fp32", rank: int = 0
) -> dict[str, Any]:
    """Parameters + gradients + AdamW state per rank for each layout, fully sharded over ``world``.

    ``ideal`` is one process's state divided by ``world``; each layout's
    ``ratio`` is its state over that (1.0: nothing wasted on padding).
    """
    ideal = unsharded_memory(units).state / world
    result: dict[str, Any] = {"ideal": ideal}
    frozen = any(u.frozen for u in units)  # the wrapper keeps the originals, as shard train
    for name, frontend, flat in _LAYOUTS:
        config = PlanConfig(
            frontend=frontend,
            strategy="full",
            world=world,
            precision=precision,
            flat=flat,
            orig_params=frozen,
        )
        estimate = estimate_memory(units, config, rank=rank)
        result[name] = {
            "params": estimate.params,
            "grads": estimate.grads,
            "optim": estimate.optim,
            "state": estimate.state,
            "ratio": estimate.state / ideal,
        }
    return result


_ROWS = (
    ("parameters", "params"),
    ("gradients", "grads"),
    ("AdamW state", "optim"),
    ("full params+grads in flight", "in_flight"),
    ("activations", "activations"),
    ("peak (estimate)", "peak"),
)


def _trainable(report: dict[str, Any]) -> str:
    """``, N trainable (P%)`` when some parameters are frozen; else nothing."""
    total, trainable = report["parameters"], report.get("trainable", report["parameters"])
    if trainable >= total:
        return ""
    return f" ({trainable:,} of {total:,} train, {trainable / total:.2%})"


def _options(options: Mapping[str, Any]) -> str:
    """``(min_num_params=1000000)`` for a policy's options; nothing without any."""
    return f"({', '.join(f'{k}={v!r}' for k, v in options.items())})" if options else ""


def format_plan(report: dict[str, Any]) -> list[str]:
    """The lines ``shard plan`` prints for a report of :func:`plan_report`."""
    r = report
    lines = [
        f"shard plan: {r['model']}",
        f"  {r['parameters'] / 1e6:.2f} M parameters{_trainable(r)}; {r['frontend']}, "
        f"{r['precision']}"
        f"{', cpu offload' if r['cpu_offload'] else ''}; wrap policy {r['wrap_policy']}"
        f"{_options(r.get('wrap_options', {}))}; "
        f"world size {r['world_size']}",
        "",
        f"units ({len(r['units'])}, children before the root in the order they shard):",
        *r["tree"],
        "",
    ]
    acts = f"batch {r['batch']} x seq {r['seq']}" if r["batch"] else "no activations"
    if r["batch"] and r["activation_checkpointing"]:
        acts += ", blocks checkpointed"
    lines.append(f"per-rank memory (rank {r['rank']}; {acts}):")
    names = list(r["strategies"])
    heads = [f"hybrid({r['hybrid_shard_size']})" if n == "hybrid" else n for n in names]
    width = 30
    lines.append(" " * width + "".join(f"{h:>14}" for h in heads) + f"{'1 process':>14}")
    for label, key in _ROWS:
        cells = [r["strategies"][n][key] for n in names] + [r["unsharded"][key]]
        lines.append(
            f"  {label:<{width - 2}}"
            + "".join(f"{format_bytes(c) if c is not None else '-':>14}" for c in cells)
        )
    if r["note"]:
        lines.append(f"  ({r['note']})")
    if "comm_per_step" in r:
        lines += _comm_lines(r, heads, width)
    layouts = r["layouts"]
    names = [n for n, _, _ in _LAYOUTS]
    lines += [
        "",
        f"per-rank state by layout (full, {r['world_size']} ranks; ideal = 1 process / "
        f"{r['world_size']} = {format_bytes(round(layouts['ideal']))}):",
        " " * width + "".join(f"{n:>14}" for n in names),
        f"  {'params+grads+AdamW':<{width - 2}}"
        + "".join(f"{format_bytes(layouts[n]['state']):>14}" for n in names),
        f"  {'ratio to ideal':<{width - 2}}"
        + "".join(f"{layouts[n]['ratio']:>13.4f}x" for n in names),
    ]
    return lines


_COMM_ROWS = (("all-gather", "all_gather"), ("reduce-scatter", "reduce_scatter"))


def _comm_lines(r: dict[str, Any], heads: list[str], width: int) -> list[str]:
    """The communication table: bytes one rank's collectives count per step, per strategy."""
    comm = r["comm_per_step"]
    names = list(comm)
    quant = r.get("comm_quant") or []
    shown = "quantized" if quant else "plain"
    what = f"--comm-quant {','.join(quant)}" if quant else "no --comm-quant"
    lines = [
        "",
        f"communication per step (rank {r['rank']}, {what}; bytes of each collective's "
        "buffer, as shard counts them):",
        " " * width + "".join(f"{h:>14}" for h in heads),
    ]
    rows = (*_COMM_ROWS, ("all-reduce (replicas)", "all_reduce"))
    for label, key in rows:
        cells = [comm[n][shown][key] for n in names]
        lines.append(f"  {label:<{width - 2}}" + "".join(f"{format_bytes(c):>14}" for c in cells))
    totals = [sum(comm[n][shown].values()) for n in names]
    lines.append(f"  {'total':<{width - 2}}" + "".join(f"{format_bytes(c):>14}" for c in totals))
    if quant:
        plain = [sum(comm[n]["plain"].values()) for n in names]
        lines.append(
            f"  {'without --comm-quant':<{width - 2}}"
            + "".join(f"{format_bytes(c):>14}" for c in plain)
        )
        lines.append(
            f"  {'ratio':<{width - 2}}"
            + "".join(
                f"{(q / p if p else 1.0):>13.3f}x" for q, p in zip(totals, plain, strict=True)
            )
        )
    if any("feedback_bytes" in comm[n] for n in names):
        kept = [comm[n].get("feedback_bytes", 0) for n in names]
        lines.append(
            f"  {'error feedback (kept)':<{width - 2}}"
            + "".join(f"{format_bytes(c):>14}" for c in kept)
        )
    return lines


def run_plan(args: argparse.Namespace) -> int:
    """``shard plan``: print the plan; the exit status."""
    try:
        if args.world < 1:
            raise ValueError(f"--world-size must be at least 1, got {args.world}")
        if not 0 <= args.rank < args.world:
            raise ValueError(f"--rank {args.rank} is not a rank of a world of {args.world}")
        source = load_model_source(
            preset=args.preset,
            model=args.model,
            hf_config=args.hf_config,
            hf_args=args.hf_args,
            overrides={
                "seq": args.seq,
                "d_model": args.d_model,
                "n_heads": args.n_heads,
                "n_layers": args.n_layers,
            },
        )
        finetuning = Finetuning(
            lora=args.lora,
            lora_targets=normalise_names("lora_targets", args.lora_targets),
            freeze=normalise_names("freeze", args.freeze or ()),
        )
        check_finetuning_flags(
            lora=finetuning.lora,
            lora_alpha=None,
            lora_targets=finetuning.lora_targets,
            freeze=finetuning.freeze,
        )
        source = finetuned_source(source, finetuning)
        report = plan_report(
            source,
            world=args.world,
            strategies=args.strategies or list(STRATEGIES),
            frontend=args.frontend,
            precision=args.precision,
            cpu_offload=args.cpu_offload,
            wrap_policy=args.wrap_policy,
            wrap_options=parse_key_values(
                args.wrap_options, flag="--wrap-option", example="min_num_params=1000000"
            ),
            shard_size=args.shard_size,
            batch=args.batch,
            seq=args.seq,
            rank=args.rank,
            flat=args.flat,
            activation_checkpointing=args.activation_checkpointing,
            comm_quant=parse_comm_quant(args.comm_quant),
        )
    except (ValueError, ShardError) as exc:
        print(f"shard plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print("\n".join(format_plan(report)))
    return 0
