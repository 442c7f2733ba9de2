"""Differential testing of shard against PyTorch's FSDP on random training configurations.

A :class:`Config` (drawn by :func:`draw_config` from any picker;
:func:`config_strategy` draws them with hypothesis, for the tests and
``tools/fuzz``) describes a small model (LoRA units, tied weights, unused
branches, activation checkpointing), which parameters are frozen before
sharding and toggled after, the front end and its options, and a few
optimizer steps. :func:`run_config` trains it on
the ranks of a ``RankPool`` under ``torch.distributed.fsdp`` and under
``shard_runtime``, and each rank compares losses, gradients, parameters and
optimizer state after every step (bitwise in fp32). ``Config.to_script()``
is a standalone reproduction. :data:`KNOWN_BUGS` lists the dimensions the CI
sample avoids because of reported shard bugs, with the reason each.
"""

from shard_testing.differential._compare import (
    Discrepancy,
    Outcome,
    first_discrepancy,
    signature,
)
from shard_testing.differential._config import BlockSpec, Config, Pick, Toggle, draw_config
from shard_testing.differential._hypothesis import config_strategy
from shard_testing.differential._known import KNOWN_BUGS, KnownBug, known_bugs_in
from shard_testing.differential._run import compare_on_rank, run_config

__all__ = [
    "KNOWN_BUGS",
    "BlockSpec",
    "Config",
    "Discrepancy",
    "KnownBug",
    "Outcome",
    "Pick",
    "Toggle",
    "compare_on_rank",
    "config_strategy",
    "draw_config",
    "first_discrepancy",
    "known_bugs_in",
    "run_config",
    "signature",
]
