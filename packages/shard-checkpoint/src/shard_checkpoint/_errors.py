"""The exceptions shard-checkpoint raises.

They derive from :class:`shard_core.errors.ShardError` like every other
shard exception. They live here rather than in ``shard_core.errors``
because only this distribution raises them and no plugin needs to catch
them; they can move down a layer without changing their names.
"""

from __future__ import annotations

from shard_core.errors import ShardError

__all__ = ["CheckpointError", "StateDictError"]


class CheckpointError(ShardError, RuntimeError):
    """A checkpoint cannot be saved, loaded or consolidated as asked.

    Raised for a save that failed on some rank (the previous checkpoint at
    that path is left in place), a checkpoint that is incomplete, and a
    checkpoint that does not match the state dict it is loaded into (a
    missing key, a different shape). The message names the checkpoint, the
    first offending key and what to do.
    """


class StateDictError(ShardError, ValueError, RuntimeError):
    """A model or optimizer state dict does not fit the model or optimizer it is loaded into.

    Raised for missing or unexpected keys under ``strict=True``, a value of
    the wrong shape, an empty state dict where one is required, and an
    optimizer that holds parameters the model does not. The message names
    the first offending key. It is a ``RuntimeError`` because PyTorch's
    ``torch.distributed.checkpoint.state_dict`` (and ``load_state_dict``)
    raise ``RuntimeError`` for these, so ``except RuntimeError`` written
    against PyTorch keeps working; it stays a ``ValueError`` for callers of
    earlier shard versions.
    """
