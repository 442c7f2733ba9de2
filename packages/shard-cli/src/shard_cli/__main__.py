"""``python -m shard_cli`` and the ``shard`` console script: ``train``, ``plan``, ``ckpt``.

[Note: a torch-free parser]
``shard --help``, ``shard train --help`` and a mistyped flag need only the
parser, but importing torch takes seconds (``torch.distributed.checkpoint``
and shard-runtime more). So the parser is built from modules that import
none of torch, shard-core, shard-comms, shard-runtime or shard-checkpoint:
``_options.py``, ``_presets.py``, ``_schedule.py``, ``_comm_quant.py``'s
parsing and help text, ``_finetune_flags.py``, ``_plan_parser.py`` and the
parsers of ``_ckpt_command.py`` and ``_debug_command.py``. Each command
imports what it runs once the command line is parsed, and the package's
public names load on first use ([Note: lazy public names] in
``__init__.py``). ``tests/test_startup.py`` checks it in a fresh interpreter.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from shard_cli._comm_quant import COMM_QUANT_HELP, check_comm_quant
from shard_cli._finetune_flags import add_finetuning_flags
from shard_cli._options import FRONTENDS, PRECISIONS, STRATEGIES, TrainOptions, resolve_options
from shard_cli._presets import PRESETS
from shard_cli._schedule import LR_SCHEDULES

__all__ = ["build_parser", "main"]

_EPILOG_TRAIN = """\
config file (--config FILE, TOML): every flag above is a key, its name without
the leading dashes and with dashes written as underscores; switches take true
or false; flags on the command line win over the file, e.g.
  steps = 200
  lr_schedule = "cosine"
  warmup_steps = 20
  activation_checkpointing = true
  freeze = ["model.embed_tokens.*", "lm_head.*"]

fine-tuning: --lora and --freeze change the model before it is sharded; only
the parameters left trainable get gradients and AdamW state (shard plan takes
the same flags), and the checkpoint holds the whole model, frozen weights
included. e.g. shard train --hf-config llama/config.json --lora 8

several machines: run the same module under torchrun on each, e.g.
  torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
      --rdzv-endpoint HOST:29500 -m shard_cli train --preset small
"""


def _add_train(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    defaults = TrainOptions()
    p = sub.add_parser(
        "train",
        help="train a GPT on shard's own sources across local ranks, and watch it",
        description=(
            "Train a character-level GPT on shard's own Python sources, sharded across N\n"
            "local ranks (CPU/gloo, or GPUs/NCCL when present), launched through\n"
            "torch.distributed.run. Rank 0 shows progress and a summary and writes\n"
            "metrics.jsonl, summary.json, training.png and sample.txt to the run directory."
        ),
        epilog=_EPILOG_TRAIN,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument(
        "--config",
        help="a TOML file of flags (keys: flag names with underscores; see below); "
        "command-line flags win",
    )
    presets = ", ".join(f"{n} ({p.description})" for n, p in PRESETS.items())
    p.add_argument(
        "--preset", choices=list(PRESETS), help=f"model size (default {defaults.preset}): {presets}"
    )
    p.add_argument(
        "--nproc-per-node",
        "--nproc",
        dest="nproc",
        type=int,
        help=f"local ranks to launch, as torchrun spells it (default {defaults.nproc})",
    )
    p.add_argument("--model", help="module:factory returning your nn.Module (token ids -> logits)")
    p.add_argument(
        "--hf-config",
        dest="hf_config",
        help="a local config.json of a transformers causal LM (needs transformers)",
    )
    p.add_argument(
        "--data",
        help="a UTF-8 text file (characters) or a .bin of token ids (default: shard's sources)",
    )
    p.add_argument(
        "--data-dtype",
        dest="data_dtype",
        choices=("uint16", "uint32"),
        help="element type of a .bin --data (default uint16)",
    )
    p.add_argument("--steps", type=int, help="optimizer steps (default: the preset's)")
    p.add_argument(
        "--batch",
        type=int,
        help="sequences per rank per micro-batch (see --grad-accum; default: the preset's)",
    )
    p.add_argument("--seq", type=int, help="sequence length (default: the preset's)")
    p.add_argument("--lr", type=float, help="AdamW learning rate (default: the preset's)")
    p.add_argument("--d-model", dest="d_model", type=int, help="override the preset's width")
    p.add_argument("--heads", dest="n_heads", type=int, help="override the preset's heads")
    p.add_argument("--layers", dest="n_layers", type=int, help="override the preset's blocks")
    p.add_argument("--seed", type=int, help=f"model and data seed (default {defaults.seed})")
    p.add_argument("--frontend", choices=FRONTENDS, help="fully_shard (default) or wrapper")
    p.add_argument("--strategy", choices=STRATEGIES, help="sharding strategy (default full)")
    p.add_argument(
        "--shard-size", dest="shard_size", type=int, help="ranks per shard group for hybrid"
    )
    p.add_argument("--precision", choices=PRECISIONS, help="fp32 (default) or bf16")
    p.add_argument(
        "--cpu-offload", dest="cpu_offload", action="store_true", help="shards on the CPU"
    )
    p.add_argument(
        "--wrap-policy",
        dest="wrap_policy",
        help="blocks (default), none, or a registered policy name (transformer, size)",
    )
    p.add_argument("--run-dir", dest="run_dir", help=f"outputs (default {defaults.run_dir})")
    p.add_argument("--ckpt-dir", dest="ckpt_dir", help="checkpoint (default RUN_DIR/checkpoint)")
    p.add_argument(
        "--ckpt-every",
        dest="ckpt_every",
        type=int,
        help=f"save every N steps and at the end; 0: at the end only ({defaults.ckpt_every})",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        choices=("latest", "latest-intact"),
        help="continue the run in --run-dir from its newest checkpoint; latest-intact: from the "
        "newest that passes its checksums, when the newest does not",
    )
    p.add_argument(
        "--async-checkpoint",
        dest="async_checkpoint",
        action="store_true",
        help="write checkpoints in the background (training waits only for a copy in memory)",
    )
    p.add_argument(
        "--keep-last",
        dest="keep_last",
        type=int,
        metavar="K",
        help="keep the K newest checkpoints, removing older ones once a new one is complete "
        "and verified (default: keep all)",
    )
    p.add_argument(
        "--sample-chars", dest="sample_chars", type=int, help="characters generated at the end"
    )
    p.add_argument(
        "--measure-step", dest="measure_step", type=int, help="the step profiled for the summary"
    )
    p.add_argument("--timeout", dest="timeout_s", type=float, help="collective timeout in seconds")
    p.add_argument(
        "--max-restarts",
        dest="max_restarts",
        type=int,
        help="restart every rank up to N times after one fails, resuming from the last "
        f"checkpoint (default {defaults.max_restarts}: a failed rank ends the run)",
    )
    _add_optimization(p)
    add_finetuning_flags(p, alpha=True)
    return p


def _add_optimization(p: argparse.ArgumentParser) -> None:
    """The flags of the optimizer step and of how blocks run; all off by default."""
    p.add_argument(
        "--warmup-steps",
        dest="warmup_steps",
        type=int,
        help="linear learning-rate warmup over the first N steps (default 0: none)",
    )
    p.add_argument(
        "--lr-schedule",
        dest="lr_schedule",
        choices=LR_SCHEDULES,
        help="after the warmup: constant (default) or cosine decay to --min-lr at the last step",
    )
    p.add_argument(
        "--min-lr", dest="min_lr", type=float, help="where the cosine ends (default 0.0)"
    )
    p.add_argument(
        "--clip-grad-norm",
        dest="clip_grad_norm",
        type=float,
        help="clip gradients to this global norm across shards; the pre-clip norm is logged "
        "(default: no clipping)",
    )
    p.add_argument(
        "--grad-accum",
        dest="grad_accum",
        type=int,
        help="micro-batches of --batch per optimizer step, gradients reduced on the last "
        "(default 1)",
    )
    p.add_argument(
        "--activation-checkpointing",
        dest="activation_checkpointing",
        action="store_true",
        help="recompute each block's activations in backward (less memory, same losses)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each block (on CPU it needs a C compiler)",
    )
    p.add_argument("--comm-quant", dest="comm_quant", metavar="PARTS", help=COMM_QUANT_HELP)
    p.add_argument(
        "--release-host-memory",
        dest="release_host_memory",
        action="store_true",
        help="give the heap memory freed in each step back to the OS after every backward "
        "(lower peak RSS per rank, a slower step)",
    )
    p.add_argument(
        "--tensorboard",
        action="store_true",
        help="also write metrics to RUN_DIR/tensorboard (needs: pip install tensorboard)",
    )


def train_parser() -> argparse.ArgumentParser:
    """The ``shard train`` parser alone (the keys of a config file come from it)."""
    holder = argparse.ArgumentParser(prog="shard")
    return _add_train(holder.add_subparsers())


def build_parser() -> argparse.ArgumentParser:
    """The ``shard`` command line; torch-free (see [Note: a torch-free parser])."""
    from shard_cli._ckpt_command import add_ckpt_parser
    from shard_cli._debug_command import add_debug_parser
    from shard_cli._plan_parser import add_plan_parser

    parser = argparse.ArgumentParser(
        prog="shard", description="shard: fully sharded data parallel training for PyTorch."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    add_plan_parser(sub)
    add_ckpt_parser(sub)
    add_debug_parser(sub)
    return parser


def _check_policy(name: str) -> None:
    """Refuse an unknown ``--wrap-policy`` before any rank starts."""
    if name in ("blocks", "none"):
        return
    from shard_core import get_registry

    names = sorted(get_registry().wrap_policies())
    if name not in names:
        raise LookupError(
            f"--wrap-policy {name!r} is not a registered wrap policy; use blocks, none or one "
            f"of {', '.join(names)} (or install the plugin that provides it)"
        )


def _with_config_file(given: dict[str, object]) -> dict[str, object]:
    """The flags ``given`` over those of ``--config`` (see ``_config_file.py``)."""
    path = given.pop("config", None)
    if path is None:
        return given
    from shard_cli._config_file import config_keys, read_config_file

    return {**read_config_file(str(path), config_keys(train_parser())), **given}


def _train(given: dict[str, object], argv: Sequence[str]) -> int:
    from shard_cli._launch import is_launched_rank, launch

    try:
        options = resolve_options(_with_config_file(dict(given)))
        _check_policy(options.wrap_policy)
        check_comm_quant(options.comm_quant)
        if options.tensorboard:
            from shard_cli._tensorboard import check_tensorboard

            check_tensorboard()
        if options.compile:
            from shard_cli._blocks import check_compiler

            check_compiler()
        if options.lora is not None:
            from shard_cli._finetune import check_peft

            check_peft()
    except (ValueError, FileNotFoundError, LookupError, ImportError) as exc:
        print(f"shard train: {exc}", file=sys.stderr)
        return 2
    if is_launched_rank():
        from shard_cli._train import run_worker

        code = run_worker(options)
        # gloo may abort in interpreter teardown; leave without it (see shard-testing's notes).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    # The user's model, or one fine-tuned by patterns and targets: fail here, not on every rank.
    if options.model or options.hf_config or options.lora is not None or options.freeze:
        from shard_cli._train import preflight

        try:
            preflight(options)
        except ValueError as exc:
            print(f"shard train: {exc}", file=sys.stderr)
            return 2
    return launch(options, list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shard`` command; the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    namespace = parser.parse_args(args)
    given = {k: v for k, v in vars(namespace).items() if k not in ("command", "run")}
    if namespace.command == "train":
        return _train(given, args[1:])
    run = namespace.run
    try:
        code: int = run(namespace)
    except BrokenPipeError:  # output piped into head, say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return code


if __name__ == "__main__":
    raise SystemExit(main())
