"""The shard command line: ``shard train``, ``shard plan``, ``shard ckpt``.

The commands are thin layers over functions usable from Python: the presets
and options of a training run, the wrap plan and per-rank memory estimate
(``plan_model_units``, ``estimate_memory``), and checkpoint inspection. The
demo's model lives in the public module :mod:`shard_cli.gpt`.

[Note: lazy public names]
Every ``shard`` command imports this package first, and most of its names
live in modules that import torch (and checkpoint inspection
``torch.distributed.checkpoint``): seconds before ``shard --help`` could
answer. So each public name is read from its module the first time it is
asked for (``__getattr__`` below, PEP 562), and kept here after that; type
checkers see only the plain imports under ``TYPE_CHECKING``.
``tests/test_startup.py`` holds the command line to it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from shard_cli._version import __version__

if TYPE_CHECKING:
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

# Each public name but __version__, and the module that defines it.
_MODULE_OF = {
    "CheckpointEntry": "_ckpt_inspect",
    "CheckpointInfo": "_ckpt_inspect",
    "inspect_checkpoint": "_ckpt_inspect",
    "CharCorpus": "_corpus",
    "load_corpus": "_corpus",
    "TrainOptions": "_options",
    "resolve_options": "_options",
    "MemoryEstimate": "_plan",
    "PlanConfig": "_plan",
    "UnitPlan": "_plan",
    "estimate_memory": "_plan",
    "plan_model_units": "_plan",
    "unsharded_memory": "_plan",
    "PRESETS": "_presets",
    "Preset": "_presets",
    "get_preset": "_presets",
}


# Hidden from type checkers: they see the imports above, and a misspelt name stays an error.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        """A public name, imported from its module on first use; see [Note: lazy public names]."""
        module = _MODULE_OF.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
