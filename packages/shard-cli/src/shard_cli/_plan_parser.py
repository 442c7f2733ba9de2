"""The ``shard plan`` parser: its flags, help and choices, without the command's imports.

``_plan_command.py`` builds models on the meta device and imports torch and
shard-runtime; this module holds only what ``shard --help`` needs, and
imports the command when a parsed command line runs it (see [Note: a
torch-free parser] in ``__main__.py``).
"""

from __future__ import annotations

import argparse

from shard_cli._comm_quant import COMM_QUANT_HELP
from shard_cli._finetune_flags import add_finetuning_flags
from shard_cli._options import FRONTENDS, PRECISIONS, STRATEGIES
from shard_cli._presets import PRESETS

__all__ = ["add_plan_parser"]


def add_plan_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``shard plan``."""
    p = sub.add_parser(
        "plan",
        help="print the wrap plan and per-rank memory of a model, without launching anything",
        description=(
            "Print the units a wrap policy makes of a model (built on the meta device) and "
            "what each rank would hold for each strategy, for any world size. Pure "
            "arithmetic: no process is started and nothing is downloaded."
        ),
    )
    p.add_argument("--preset", choices=list(PRESETS), help="a built-in GPT size (default small)")
    p.add_argument("--model", help="module:factory returning an nn.Module")
    p.add_argument(
        "--hf-config",
        dest="hf_config",
        help="a local transformers config.json (file or directory) or a config class name",
    )
    p.add_argument(
        "--hf-arg",
        dest="hf_args",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config keyword argument (repeatable), e.g. n_layer=48",
    )
    p.add_argument("--world-size", dest="world", type=int, default=2, help="ranks (default 2)")
    p.add_argument(
        "--strategy",
        dest="strategies",
        action="append",
        choices=STRATEGIES,
        help="strategies to show (repeatable; default all four)",
    )
    p.add_argument("--shard-size", dest="shard_size", type=int, help="hybrid shard group size")
    p.add_argument("--frontend", choices=FRONTENDS, default="fully_shard")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32")
    p.add_argument("--cpu-offload", dest="cpu_offload", action="store_true")
    p.add_argument(
        "--flat",
        action="store_true",
        help="fully_shard with flat_shard_placement (shard matrices on their flattened "
        "storage) in the strategy columns; the layout table always shows both",
    )
    p.add_argument(
        "--activation-checkpointing",
        dest="activation_checkpointing",
        action="store_true",
        help="as shard train --activation-checkpointing: each block keeps only its input "
        "from forward to backward and recomputes its activations there",
    )
    p.add_argument(
        "--wrap-policy",
        dest="wrap_policy",
        default="auto",
        help="auto (default: blocks for presets, else transformer), blocks, none, or a "
        "registered policy name",
    )
    p.add_argument(
        "--wrap-option",
        dest="wrap_options",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of a registered --wrap-policy (repeatable; VALUE read as JSON when it "
        "is), e.g. --wrap-policy size --wrap-option min_num_params=1000000",
    )
    add_finetuning_flags(p, alpha=False)
    p.add_argument("--comm-quant", dest="comm_quant", metavar="PARTS", help=COMM_QUANT_HELP)
    p.add_argument("--batch", type=int, help="sequences per rank for the activation estimate")
    p.add_argument("--seq", type=int, help="sequence length for the activation estimate")
    p.add_argument("--d-model", dest="d_model", type=int, help="override the preset's width")
    p.add_argument("--heads", dest="n_heads", type=int, help="override the preset's heads")
    p.add_argument("--layers", dest="n_layers", type=int, help="override the preset's blocks")
    p.add_argument(
        "--rank", type=int, default=0, help="the rank described (default 0, the largest)"
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    """``shard plan`` on parsed flags: :func:`~shard_cli._plan_command.run_plan`, imported now."""
    from shard_cli._plan_command import run_plan

    return run_plan(args)
