"""The shard command line: ``shard train``, ``shard plan``, ``shard ckpt``.

The commands are thin layers over functions usable from Python: the presets
and options of a training run, the wrap plan and per-rank memory estimate
(``plan_model_units``, ``estimate_memory``), and checkpoint inspection. The
demo's model lives in the public module :mod:`shard_cli.gpt`.
"""

from shard_cli._ckpt_inspect import CheckpointEntry, CheckpointInfo, inspect_checkpoint
from shard_cli._corpus import CharCorpus, load_corpus
from shard_cli._options import TrainOptions, resolve_options
from shard_cli._plan import (
    MemoryEstimate,
    PlanConfig,
    UnitPlan,
    estimate_memory,
    plan_model_units,
    unsharded_memory,
)
from shard_cli._presets import PRESETS, Preset, get_preset
from shard_cli._version import __version__

__all__ = [
    "CharCorpus",
    "CheckpointEntry",
    "CheckpointInfo",
    "MemoryEstimate",
    "PRESETS",
    "PlanConfig",
    "Preset",
    "TrainOptions",
    "UnitPlan",
    "__version__",
    "estimate_memory",
    "get_preset",
    "inspect_checkpoint",
    "load_corpus",
    "plan_model_units",
    "resolve_options",
    "unsharded_memory",
]
