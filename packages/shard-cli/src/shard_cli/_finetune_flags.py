"""The fine-tuning flags of ``shard train`` and ``shard plan``: ``--lora``, ``--freeze`` and kin.

Kept out of ``_finetune.py``, which imports torch to change the model, so
that the parser ``shard --help`` builds stays torch-free (see [Note: a
torch-free parser] in ``__main__.py``). What the flags do: [Note:
fine-tuning before sharding] in ``_finetune.py``.
"""

from __future__ import annotations

import argparse

__all__ = ["add_finetuning_flags"]


def add_finetuning_flags(p: argparse.ArgumentParser, *, alpha: bool) -> None:
    """``--lora``, ``--lora-targets``, ``--freeze`` (and ``--lora-alpha``, training only).

    ``shard plan`` takes the same flags (alpha changes no byte), so a plan
    counts what the run trains; see ``_finetune.py``.
    """
    p.add_argument(
        "--lora",
        type=int,
        metavar="RANK",
        help="add LoRA adapters of this rank (Hugging Face peft; pip install peft) to the "
        "linear layers of the model's blocks before sharding; the base weights are frozen "
        "and only the adapters train",
    )
    if alpha:
        p.add_argument(
            "--lora-alpha",
            dest="lora_alpha",
            type=float,
            metavar="ALPHA",
            help="scale the adapters' output by ALPHA / RANK (default 2 x RANK)",
        )
    p.add_argument(
        "--lora-targets",
        dest="lora_targets",
        metavar="NAMES",
        help="comma-separated names (or dotted suffixes of names) of the modules that get "
        "adapters, e.g. q_proj,v_proj (default: every linear layer of the model's blocks)",
    )
    p.add_argument(
        "--freeze",
        action="append",
        metavar="PATTERN",
        help="freeze the parameters whose qualified name matches this shell-style (fnmatch) "
        "pattern, e.g. 'model.embed_tokens.*' (* matches dots too); repeatable; applied "
        "after --lora, over its names (...q_proj.base_layer.weight)",
    )
