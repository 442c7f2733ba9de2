"""Registry hooks of shard-checkpoint (the wrapper reaches its state-dict methods through them)."""

from __future__ import annotations

from shard_checkpoint._wrapper_backend import WrapperStateDictBackend
from shard_core import hookimpl
from shard_core.protocols import StateDictBackend

__all__ = ["shard_state_dict_backend"]

_BACKEND = WrapperStateDictBackend()


@hookimpl
def shard_state_dict_backend() -> StateDictBackend:
    """shard-checkpoint's full and sharded state dicts of ``FullyShardedDataParallel``."""
    return _BACKEND
