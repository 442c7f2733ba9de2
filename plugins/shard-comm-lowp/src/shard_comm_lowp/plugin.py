"""Registry hooks of this plugin: the two compression hooks, by name."""

from __future__ import annotations

from collections.abc import Mapping

from shard_comm_lowp._compress import bf16_compress, fp16_compress
from shard_core import hookimpl
from shard_core.protocols import CommHook

__all__ = ["shard_comm_hooks"]


@hookimpl
def shard_comm_hooks() -> Mapping[str, CommHook]:
    """Register ``"fp16_compress"`` and ``"bf16_compress"``."""
    return {"bf16_compress": bf16_compress, "fp16_compress": fp16_compress}
