"""A directory of checkpoints, one per training step: ``<root>/step-<N>`` (torchtitan's layout).

``load`` and ``resolve_checkpoint`` given ``<root>`` read its newest
complete step; :func:`newest_intact_checkpoint` is the newest that also
verifies, the one to fall back to; :func:`prune_checkpoints` removes the
older ones once a new one is in place.

[Note: pruning step checkpoints]
``prune_checkpoints(root, keep_last=K, newest=step_dir)`` runs after
``newest`` was saved with ``verify=True`` (complete, renamed into place,
every file read back against its checksums): it is the newest intact
checkpoint, and it is never removed. It removes, in this order:

1. steps above ``newest``'s: they belong to another trajectory (an earlier
   run in the same directory, or steps after the checkpoint a run fell back
   to), and would otherwise be taken for the newest;
2. with ``keep_last=K``, complete steps older than the ``K`` newest (``newest``
   among them);
3. leftovers of earlier saves (``step-<N>.incomplete-*`` of saves that died,
   ``step-<N>.old`` of a swap that was interrupted, ``step-<N>.removing-*``
   of a prune that was): the process saves one checkpoint at a time, and
   its last one is complete, so none of them is being written.

A directory is removed by renaming it to ``<name>.removing-<token>`` first,
then deleting that, so an interrupted prune never leaves a step directory
that looks complete but lacks files.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from pathlib import Path

from shard_checkpoint._errors import CheckpointError
from shard_checkpoint._integrity import METADATA_FILE, DirectorySource, verify

__all__ = [
    "STEP_PREFIX",
    "latest_checkpoint",
    "newest_intact_checkpoint",
    "prune_checkpoints",
    "step_checkpoint_id",
    "step_checkpoints",
    "step_of",
]

_log = logging.getLogger("shard.checkpoint")

STEP_PREFIX = "step-"
_STEP = re.compile(rf"^{STEP_PREFIX}(\d+)$")
_LEFTOVER = re.compile(rf"^{STEP_PREFIX}(\d+)\.(?:incomplete-[0-9a-f]+|old|removing-[0-9a-f]+)$")


def step_checkpoint_id(root: str | os.PathLike[str], step: int) -> Path:
    """The checkpoint directory of ``step`` under ``root``: ``<root>/step-<step>``."""
    if step < 0:
        raise ValueError(f"a step checkpoint needs a step of 0 or more, got {step}")
    return Path(root) / f"{STEP_PREFIX}{step}"


def step_of(path: str | os.PathLike[str]) -> int | None:
    """The step of a ``step-<N>`` directory's path; ``None`` for another name."""
    match = _STEP.match(Path(path).name)
    return int(match.group(1)) if match else None


def step_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """The complete ``step-<N>`` checkpoints in ``root`` (with ``.metadata``), oldest first."""
    root = Path(root)
    try:
        children = list(root.iterdir())
    except OSError:
        return []
    found = [
        (step, child)
        for child in children
        if (step := step_of(child)) is not None and (child / METADATA_FILE).is_file()
    ]
    return [child for _, child in sorted(found)]


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete ``step-<N>`` checkpoint in ``root`` (not verified); ``None``: none."""
    steps = step_checkpoints(root)
    return steps[-1] if steps else None


def _checkpoints_newest_first(root: Path, besides: Path | None) -> list[Path]:
    """The complete checkpoints in ``root`` but ``besides``: newest step first, then save time."""
    candidates: list[tuple[int, float, str, Path]] = []
    try:
        children = list(root.iterdir())
    except OSError:
        return []
    for child in children:
        if child == besides or not (child / METADATA_FILE).is_file():
            continue
        if ".incomplete-" in child.name or ".removing-" in child.name:
            continue
        step = step_of(child)
        try:
            saved = (child / METADATA_FILE).stat().st_mtime
        except OSError:
            continue
        candidates.append((-1 if step is None else step, saved, child.name, child))
    return [path for *_, path in sorted(candidates, reverse=True)]


def newest_intact_checkpoint(
    root: str | os.PathLike[str], *, besides: str | os.PathLike[str] | None = None
) -> Path | None:
    """The newest checkpoint under ``root`` whose every file matches its checksums.

    Steps are tried newest first (then other checkpoint directories, newest
    save first), reading each in full until one verifies; a checkpoint
    without checksums is not taken, as nothing shows it intact.

    Args:
        root: The directory holding the checkpoints.
        besides: A checkpoint under ``root`` to leave out (the one that failed).
    """
    root = Path(root)
    for candidate in _checkpoints_newest_first(root, None if besides is None else Path(besides)):
        try:
            checked = verify(str(candidate), DirectorySource(candidate))
        except CheckpointError:
            continue
        if checked.manifest is not None:
            return candidate
    return None


def prune_checkpoints(
    root: str | os.PathLike[str], *, newest: str | os.PathLike[str], keep_last: int | None
) -> list[Path]:
    """Remove what ``newest`` supersedes under ``root``; see [Note: pruning step checkpoints].

    One process only (rank 0): it works on the file system alone.

    Args:
        root: The directory of ``step-<N>`` checkpoints.
        newest: The step checkpoint just saved and verified; it stays.
        keep_last: How many complete steps to keep, ``newest`` included;
            ``None`` keeps every step up to ``newest``'s.

    Returns:
        The directories removed (their names before removal), in order.

    Raises:
        ValueError: ``keep_last`` is below 1, or ``newest`` is not a step
            checkpoint under ``root``.
    """
    root, newest = Path(root), Path(newest)
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be at least 1 (the newest checkpoint), got {keep_last}")
    top = step_of(newest)
    if top is None or newest.parent != root or not (newest / METADATA_FILE).is_file():
        raise ValueError(f"{newest} is not a complete step-<N> checkpoint directory in {root}")
    complete = step_checkpoints(root)
    doomed = [path for path in complete if (step_of(path) or 0) > top]
    older = [path for path in complete if (step_of(path) or 0) < top]
    if keep_last is not None:
        doomed += older[: max(0, len(older) - (keep_last - 1))]
    doomed += [child for child in sorted(root.iterdir()) if _LEFTOVER.match(child.name)]
    removed = []
    for path in doomed:
        if path == newest:  # cannot happen; never remove the checkpoint just saved
            continue
        _remove_directory(path)
        removed.append(path)
    if removed:
        _log.info(
            "shard.checkpoint: removed %s (kept %s)", ", ".join(p.name for p in removed), newest
        )
    return removed


def _remove_directory(path: Path) -> None:
    """Remove ``path``; see [Note: pruning step checkpoints] for the rename first."""
    if ".removing-" in path.name:
        shutil.rmtree(path, ignore_errors=True)
        return
    doomed = path.with_name(f"{path.name}.removing-{uuid.uuid4().hex[:12]}")
    try:
        os.replace(path, doomed)
    except OSError:
        return
    shutil.rmtree(doomed, ignore_errors=True)
