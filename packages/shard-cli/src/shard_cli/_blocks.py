"""What ``--activation-checkpointing`` and ``--compile`` do to each block before sharding.

[Note: wrapping a block's forward]
Each block's ``forward`` is replaced, on the instance, by the same forward
compiled (``torch.compile``) and/or run under non-reentrant
``torch.utils.checkpoint`` (its activations are recomputed in backward
instead of kept). Nothing else about the module changes: no wrapper module
is inserted, so parameter names, state-dict keys and checkpoints are those
of the plain model, a run may resume with or without either flag, and the
runtime's hooks stay on the block's ``__call__`` where sharding put them:
the block's parameters are gathered before the (compiled, checkpointed)
forward runs and, in backward, before the recomputation runs, since the
runtime gathers a unit when the gradient of its output arrives, before any
of its own backward (the recomputation included) runs. The recomputation
replays the forward with the random state of the first run, so a block
with dropout computes the same values twice and the losses do not change.

The blocks are the units the model's default wrap policy makes (shard's
GPT: each ``Block``; a user's model: each repeated layer the
``transformer`` policy finds), whatever ``--wrap-policy`` shards by.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shard_cli._model_source import ModelSource
from shard_cli._strategy import resolve_policy
from shard_cli.gpt import GPT
from shard_core.errors import ShardError
from shard_runtime.plumbing import plan_units, resolve_wrap_policy

__all__ = ["check_compiler", "checkpointed_blocks", "find_blocks", "wrap_blocks"]


def check_compiler() -> None:
    """Fail before training when ``--compile`` cannot build CPU code.

    On the CPU, ``torch.compile`` (Inductor) compiles C++ with ``$CXX``, by
    default ``g++`` (``clang++`` on macOS), and would otherwise fail inside
    the first step with a long compiler-search error. GPUs compile with
    Triton, which needs no C++ compiler named here.

    Raises:
        ValueError: no CUDA device and no such compiler on ``PATH``.
    """
    if torch.cuda.is_available() or sys.platform == "win32":
        return
    compiler = os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")
    if shutil.which(compiler) is None:
        raise ValueError(
            f"--compile on the CPU needs a C++ compiler for torch.compile, and {compiler!r} "
            "(from $CXX, default g++) is not on PATH; install one (apt-get install g++) or "
            "set CXX to it, or drop --compile"
        )


def find_blocks(model: nn.Module, policy: Any, *, what: str, flags: str) -> list[nn.Module]:
    """The blocks of ``model``: shard's GPT's, or the non-root units of ``policy``.

    ``what`` names the model and ``flags`` the options asking, for the error.

    Raises:
        ValueError: the policy finds no block (the model has no repeated layers).
    """
    if isinstance(model, GPT):
        return list(model.iter_blocks())
    try:
        targets = plan_units(model, resolve_wrap_policy(policy)) if policy is not None else []
    except ShardError:
        targets = []
    blocks = [t.module for t in targets if t.name]
    if not blocks:
        raise ValueError(
            f"{flags}: {what} has no blocks (repeated layers) that shard finds to apply it "
            "to; drop the flag, or build the model from repeated layers"
        )
    return blocks


def checkpointed_blocks(model: nn.Module, source: ModelSource) -> list[str]:
    """The qualified names of the blocks ``--activation-checkpointing`` wraps in ``model``.

    What ``shard plan`` and ``shard train``'s prediction treat as recomputed units.
    """
    blocks = find_blocks(
        model,
        resolve_policy(source.default_policy),
        what=source.description,
        flags="--activation-checkpointing",
    )
    name_of = {id(module): name for name, module in model.named_modules()}
    return [name_of[id(block)] for block in blocks]


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def wrap_blocks(blocks: list[nn.Module], *, checkpointing: bool, compile: bool) -> None:
    """Replace each block's forward; see [Note: wrapping a block's forward]."""
    for block in blocks:
        forward: Callable[..., Any] = block.forward
        if compile:
            forward = torch.compile(forward)
        if checkpointing:
            forward = _checkpointed(forward)
        block.forward = forward  # on the instance: see the note
