"""The wrappers' segments in qualified names, and names without them.

``FullyShardedDataParallel`` holds the module it wraps as
``_fsdp_wrapped_module``, and PyTorch's activation-checkpointing and offload
wrappers (``checkpoint_wrapper``, ``offload_wrapper``) hold theirs as
``_checkpoint_wrapped_module``, so parameter and module names under them
carry those segments, as in PyTorch. State dicts, checkpoints and messages
use the names of the unwrapped model, as PyTorch's do: :func:`clean_fqn`
strips both segments, so that a model trained with
``apply_activation_checkpointing`` saves the keys the plain model loads.
"""

from __future__ import annotations

__all__ = ["CHECKPOINT_WRAPPED", "WRAPPED", "WRAPPED_PREFIX", "clean_fqn"]

WRAPPED = "_fsdp_wrapped_module"
WRAPPED_PREFIX = f"{WRAPPED}."
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"
"""Where ``torch.distributed.algorithms._checkpoint``'s wrappers hold the module they wrap."""


def clean_fqn(name: str) -> str:
    """A qualified name without ``_fsdp_wrapped_module`` or ``_checkpoint_wrapped_module`` parts."""
    kept = [part for part in name.split(".") if part not in (WRAPPED, CHECKPOINT_WRAPPED)]
    return ".".join(kept)
