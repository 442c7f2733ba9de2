"""One warning when a framework that checks PyTorch's FSDP classes runs beside shard unintegrated.

A Lightning user who writes ``from shard_runtime import fully_shard`` in a
``parallelize_fn`` (README's one-import switch) trains, but Lightning asks
``isinstance(module, torch.distributed.fsdp.FSDPModule)`` and gets ``False``:
``fabric.no_backward_sync`` is silently off and every micro-batch reduces.
``use_shard_for_torch_fsdp()`` fixes that, and this module tells the user who
has not called it, once per process, at the first ``fully_shard`` or
``FullyShardedDataParallel`` of shard's.

[Note: which frameworks count as in use]
Importing a module is not using it: ``import transformers`` (any Hugging Face
model) imports ``accelerate`` and its ``Accelerator`` class. So each
framework has its own sign of use: Lightning's and torchtitan's packages are
imported only by their users; accelerate counts once its process state
exists (an ``Accelerator`` or ``PartialState`` was created); transformers
once its ``Trainer`` module is imported. None of the checks imports anything.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from shard_core.errors import FrameworkIntegrationWarning

__all__ = ["ENV_FRAMEWORK_CHECK", "frameworks_in_use", "warn_if_unintegrated"]

ENV_FRAMEWORK_CHECK = "SHARD_FRAMEWORK_CHECK"
"""``0`` turns the check off (as does filtering :class:`FrameworkIntegrationWarning`)."""


@dataclass(frozen=True, slots=True)
class _Framework:
    name: str
    in_use: Callable[[], bool]
    misses: str  # what it will not recognise


def _imported(*packages: str) -> Callable[[], bool]:
    return lambda: any(package in sys.modules for package in packages)


def _accelerate_state_exists() -> bool:
    state = sys.modules.get("accelerate.state")
    partial = getattr(state, "PartialState", None)
    return bool(getattr(partial, "_shared_state", None))


_FRAMEWORKS = (
    _Framework(
        "Lightning",
        _imported("lightning", "lightning_fabric", "pytorch_lightning"),
        "its isinstance(module, FSDPModule) checks: fabric.no_backward_sync would not skip the "
        "gradient reduction, and its FSDP checkpointing would not see the sharded modules",
    ),
    _Framework(
        "torchtitan",
        _imported("torchtitan"),
        "the fully_shard and FSDPModule it bound at import: its parallelize functions and "
        "FSDPModule calls (set_gradient_divide_factor, ...) would not reach shard's units",
    ),
    _Framework(
        "accelerate",
        _accelerate_state_exists,
        "its isinstance(model, FSDPModule) checks: save_state/load_state, get_state_dict and "
        "unwrap_model would treat shard's modules as unsharded",
    ),
    _Framework(
        "transformers' Trainer",
        _imported("transformers.trainer"),
        "the FSDP checks it makes through accelerate: saving and loading would treat shard's "
        "modules as unsharded",
    ),
)

_LOCK = threading.Lock()
_WARNED = False


def frameworks_in_use() -> list[str]:
    """The names of the frameworks this process uses (see [Note: which frameworks count])."""
    return [f.name for f in _FRAMEWORKS if f.in_use()]


def _integration_active() -> bool:
    integration = sys.modules.get("shard_runtime.integrations.torch_fsdp")
    active = getattr(integration, "integration_active", None)
    return bool(active()) if callable(active) else False


def warn_if_unintegrated(front_end: str, *, stacklevel: int) -> None:
    """Warn once per process if a framework is in use and PyTorch's FSDP names are PyTorch's.

    ``front_end`` names the call (``fully_shard``); ``stacklevel`` counts from
    the caller of this function to the user's line.
    """
    global _WARNED
    if os.environ.get(ENV_FRAMEWORK_CHECK, "1") == "0":
        return
    with _LOCK:
        if _WARNED:
            return
        used = [f for f in _FRAMEWORKS if f.in_use()]
        if not used or _integration_active():
            return
        _WARNED = True
    names = ", ".join(f.name for f in used)
    details = "; ".join(f"{f.name}: {f.misses}" for f in used)
    warnings.warn(
        f"shard's {front_end} runs in a process that uses {names}, which recognises sharded "
        "modules by PyTorch's FSDP classes and will not recognise shard's without the "
        f"integration. It would miss {details}. Call "
        "shard_runtime.use_shard_for_torch_fsdp() before the framework shards the model "
        "(README: 'Using shard from Lightning / torchtitan / accelerate'); "
        f"{ENV_FRAMEWORK_CHECK}=0 turns this check off.",
        FrameworkIntegrationWarning,
        stacklevel=stacklevel + 1,
    )
