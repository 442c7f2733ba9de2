"""The exceptions shard-checkpoint raises.

They derive from :class:`shard_core.errors.ShardError` like every other
shard exception. They live here rather than in ``shard_core.errors``
because only this distribution raises them and no plugin needs to catch
them; they can move down a layer without changing their names.
"""

from __future__ import annotations

from shard_core.errors import ShardError

__all__ = ["CheckpointError", "CorruptCheckpointError", "StateDictError"]


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


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's bytes differ from those its save wrote (checksums, file sizes).

    Raised when loading or verifying a checkpoint whose data file, ``.metadata``
    or checksum file was changed, cut short or deleted after the save
    completed. The message is one sentence naming the checkpoint, the file,
    the rank that wrote it, the key (and chunk) whose bytes are affected, and
    the newest intact checkpoint beside it, if any; the same facts are
    attributes, for a caller that falls back on its own.

    Attributes:
        checkpoint: The checkpoint directory.
        file: The damaged file, relative to ``checkpoint``.
        problem: What is wrong with it ("does not match its checksum", ...).
        rank: The rank that wrote ``file``; ``None`` when not known (a
            checkpoint file of the whole save: ``.metadata``, the checksums).
        key: The flat key whose bytes are affected (the first, when several);
            ``None`` for a file that holds no key's data.
        offsets: The affected chunk's offsets in the full tensor (a tensor
            saved in pieces); ``None`` for a whole value.
        byte_range: ``(start, end)`` of the bytes that fail, in ``file``;
            ``None`` when the whole file is missing or has the wrong size.
        intact: The newest checkpoint beside ``checkpoint`` (same parent
            directory) that verifies completely; ``None`` if there is none or
            it was not looked for.
        searched: Whether ``intact`` was looked for.
        fix: What the message tells to do about an ``intact`` checkpoint
            (a caller's own way to resume from it); ``None``: "load that one".
    """

    def __init__(
        self,
        *,
        checkpoint: str,
        file: str,
        problem: str,
        rank: int | None = None,
        key: str | None = None,
        offsets: tuple[int, ...] | None = None,
        byte_range: tuple[int, int] | None = None,
        intact: str | None = None,
        searched: bool = False,
        fix: str | None = None,
    ) -> None:
        self.checkpoint = checkpoint
        self.file = file
        self.problem = problem
        self.rank = rank
        self.key = key
        self.offsets = offsets
        self.byte_range = byte_range
        self.intact = intact
        self.searched = searched
        self.fix = fix
        super().__init__(self._message())

    def _fields(self) -> dict[str, object]:
        return {
            "checkpoint": self.checkpoint,
            "file": self.file,
            "problem": self.problem,
            "rank": self.rank,
            "key": self.key,
            "offsets": self.offsets,
            "byte_range": self.byte_range,
            "intact": self.intact,
            "searched": self.searched,
            "fix": self.fix,
        }

    def __reduce__(self) -> tuple[object, ...]:
        # DCP sends a failing rank's exception to every rank (pickled): keep the attributes.
        return (_rebuild_corrupt, (self._fields(),))

    def with_intact(self, intact: str | None) -> CorruptCheckpointError:
        """The same error, naming ``intact`` as the newest intact checkpoint beside it."""
        fields = self._fields()
        fields.update(intact=intact, searched=True)
        return _rebuild_corrupt(fields)

    def with_fix(self, fix: str) -> CorruptCheckpointError:
        """The same error, telling to ``fix`` (e.g. a command) where it names an intact one."""
        fields = self._fields()
        fields.update(fix=fix)
        return _rebuild_corrupt(fields)

    def location(self) -> str:
        """Where in the file: `` at bytes A-B (the data of 'key', chunk at offsets (..))``."""
        where = ""
        if self.byte_range is not None:
            where = f" at bytes {self.byte_range[0]}-{self.byte_range[1]}"
        if self.key is not None:
            chunk = f", chunk at offsets {self.offsets}" if self.offsets is not None else ""
            where += f" (the data of {self.key!r}{chunk})"
        return where

    def _message(self) -> str:
        writer = f" (written by rank {self.rank})" if self.rank is not None else ""
        where = self.location()
        if self.intact is not None:
            after = (
                f"the newest intact checkpoint beside it is {self.intact}: "
                f"{self.fix or 'load that one'}"
            )
        elif self.searched:
            after = (
                "no intact checkpoint is beside it: restore it from a copy, or train again "
                "from the start"
            )
        else:
            after = "load an earlier checkpoint"
        return (
            f"checkpoint {self.checkpoint} is corrupt: {self.file}{writer} {self.problem}{where}; "
            "it changed after its save completed (a disk, copy or transfer error, or a file "
            f"edited or removed by hand), so loading it would give wrong values; {after}"
        )


def _rebuild_corrupt(fields: dict[str, object]) -> CorruptCheckpointError:
    return CorruptCheckpointError(**fields)  # type: ignore[arg-type]
