"""The wrapper's segment in qualified names, and names without it.

``FullyShardedDataParallel`` holds the module it wraps as
``_fsdp_wrapped_module``, so parameter and module names under a wrapper carry
that segment, as in PyTorch. State dicts, checkpoints and messages use the
names of the unwrapped model: :func:`clean_fqn` strips the segment.
"""

from __future__ import annotations

__all__ = ["WRAPPED", "WRAPPED_PREFIX", "clean_fqn"]

WRAPPED = "_fsdp_wrapped_module"
WRAPPED_PREFIX = f"{WRAPPED}."


def clean_fqn(name: str) -> str:
    """A qualified name without the wrapper's internal ``_fsdp_wrapped_module`` segments."""
    return name.replace(WRAPPED_PREFIX, "").removesuffix(f".{WRAPPED}").removeprefix(WRAPPED)
