"""Saving and loading checkpoints through ``torch.distributed.checkpoint``, atomically.

A checkpoint is a DCP directory (``.metadata`` plus one ``.distcp`` file per
saving rank), so PyTorch's tools read ours and we read theirs, and DTensors
saved at one world size load at another. What this module adds is when the
directory appears under its name, and errors that say what is wrong.

[Note: atomic checkpoints]
``save(..., checkpoint_id=path)`` never writes into ``path``. Rank 0 creates
``<path>.incomplete-<token>`` and broadcasts its name; every rank writes its
files there through DCP, whose last step (after every rank has written) is
rank 0 writing ``.metadata``. Only then does rank 0 swap the directories:

1. an existing ``<path>`` is renamed to ``<path>.old`` (a stale ``.old`` from
   an earlier interrupted swap is removed first: ``<path>`` is complete);
2. ``<path>.incomplete-<token>`` is renamed to ``<path>``;
3. ``<path>.old`` is removed,

and broadcasts the outcome, so no rank returns before the checkpoint is in
place. A save that dies before step 2 leaves ``<path>`` as it was and the
new files in a directory whose name says they are incomplete. Dying between
steps 1 and 2 leaves only ``<path>.old``, which ``load`` falls back to (with a
logged warning). Renames within one directory are atomic on POSIX file
systems; ``checkpoint_id`` must be a directory path every rank sees.
An existing ``<path>`` that is neither a checkpoint nor empty is refused,
never replaced.

Before step 1 rank 0 also writes the checkpoint's checksums
([Note: checkpoint checksums] in ``_checksums.py``), from every rank's
record of the files it wrote; with ``verify=True`` each rank first reads
its files back against them, and a file that does not read back as
written fails the save. ``load`` checks them as it reads
([Note: what is verified when] in ``_integrity.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import errno
import logging
import os
import pickle
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlanner
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from shard_checkpoint import _pending
from shard_checkpoint._checksums import (
    CHECKSUMS_FILE,
    FileChecksums,
    Manifest,
    encode_manifest,
    file_checksums,
)
from shard_checkpoint._dist import all_gather_objects, broadcast_object, rank
from shard_checkpoint._errors import CheckpointError, CorruptCheckpointError, StateDictError
from shard_checkpoint._integrity import (
    METADATA_FILE,
    Checked,
    ChecksummingWriter,
    DirectorySource,
    VerifyingReader,
    check_segments,
    check_structure,
    verify,
)
from shard_checkpoint._steps import STEP_PREFIX, latest_checkpoint, newest_intact_checkpoint

__all__ = [
    "check_against_metadata",
    "first_corruption",
    "load",
    "newest_intact_beside",
    "quiet_single_process",
    "resolve_checkpoint",
    "save",
    "save_now",
    "verify_checkpoint",
]

_log = logging.getLogger("shard.checkpoint")

INCOMPLETE_MARK = ".incomplete-"
OLD_SUFFIX = ".old"


def save(
    state_dict: Mapping[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str],
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    verify: bool = False,
) -> Metadata:
    """Write ``state_dict`` as a DCP checkpoint at ``checkpoint_id``, atomically, with checksums.

    Call it on every rank of ``process_group`` (the default group when
    ``None``) with the same keys. See [Note: atomic checkpoints].

    Args:
        state_dict: nested dicts of tensors, DTensors (each rank writes its
            shards), other picklable values and ``Stateful`` objects.
        checkpoint_id: the checkpoint's directory; an existing checkpoint there
            is replaced only once the new one is complete.
        storage_writer: a DCP storage writer to write through (it is reset to
            the staging directory); ``None``: DCP's ``FileSystemWriter``,
            recording checksums. A writer of your own writes none (the
            checkpoint then loads unverified).
        planner: a DCP save planner; ``None``: DCP's default.
        process_group: the ranks that save together.
        verify: each rank reads back the files it wrote (from the storage,
            not the page cache, where the OS allows) and checks them against
            their checksums before the checkpoint is put in place; a
            difference fails the save. Costs one read of the checkpoint.

    Returns:
        The checkpoint's DCP metadata.

    Raises:
        CheckpointError: ``checkpoint_id`` is taken by something that is not a
            checkpoint, or the save failed on some rank, or (``verify``) a
            file did not read back as written (every rank raises; the
            previous checkpoint is untouched), or the asynchronous save in
            flight (``async_save``), which this waits for first, failed.
    """
    _pending.wait()
    return save_now(
        state_dict,
        checkpoint_id=checkpoint_id,
        storage_writer=storage_writer,
        planner=planner,
        process_group=process_group,
        verify=verify,
    )


def save_now(
    state_dict: Mapping[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str],
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    verify: bool = False,
) -> Metadata:
    """:func:`save` without waiting for the save in flight (the background thread's save)."""
    path = Path(checkpoint_id)
    staging = _decided_on_rank0(lambda: _prepare_save(path), process_group)
    writer = storage_writer if storage_writer is not None else ChecksummingWriter(staging)
    try:
        with quiet_single_process():
            metadata = dcp_save(
                dict(state_dict),
                checkpoint_id=staging,
                storage_writer=writer,
                planner=planner,
                process_group=process_group,
                no_dist=not _distributed(),
            )
    except (CheckpointException, dist.DistError) as exc:
        # DistError: a rank died or fell out of step and a collective timed out.
        raise _save_failure(exc, path, Path(staging), process_group) from exc
    assert isinstance(metadata, Metadata)
    written = _written_files(
        writer, metadata, Path(staging), verify=verify, group_rank=rank(process_group)
    )
    everyone = all_gather_objects(written, process_group)
    outcome: str | None = None
    if rank(process_group) == 0:
        try:
            outcome = _unverified(everyone, path, Path(staging))
            if outcome is None:
                _write_checksums(Path(staging), everyone)
                _swap(Path(staging), path)
        except OSError as exc:
            outcome = (
                f"saving checkpoint {path}: every rank wrote its files to {staging}, but "
                f"moving them into place failed: {exc}; load({str(path)!r}) still finds the "
                f"previous checkpoint (there, or at {path}{OLD_SUFFIX})"
            )
    outcome = broadcast_object(outcome, process_group)
    if outcome is not None:
        raise CheckpointError(outcome)
    return metadata


def load(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str],
    storage_reader: StorageReader | None = None,
    planner: LoadPlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    strict: bool = True,
) -> None:
    """Load the checkpoint at ``checkpoint_id`` into ``state_dict``, in place.

    Tensors are filled in place (a DTensor receives its own shards, whatever
    world size saved them); other values are replaced. Call it on every rank
    of ``process_group`` with the same keys.

    Args:
        state_dict: the values to fill, e.g. ``{"model": get_model_state_dict(model)}``.
        checkpoint_id: the checkpoint's directory, or a directory of
            ``step-<N>`` checkpoints (the newest complete one is loaded). Where
            a save was interrupted mid-swap and only ``<checkpoint_id>.old``
            exists, that is loaded.
        storage_reader: a DCP storage reader; ``None``: DCP's
            ``FileSystemReader``, checking every item's bytes against the
            checkpoint's checksums before decoding them (a checkpoint without
            checksums, as PyTorch's DCP writes, loads unverified, with a
            logged warning).
        planner: a DCP load planner; ``None``: DCP's default, after checking
            every key, shape and data file against the checkpoint.
        process_group: the ranks that load together.
        strict: a key of ``state_dict`` the checkpoint lacks is an error;
            ``False``: such values are left as they are.

    Raises:
        CorruptCheckpointError: a file of the checkpoint differs from what its
            save wrote (checksum, size, a file missing); the message names the
            file, the rank that wrote it, the key, and the newest intact
            checkpoint beside it. Raised on every rank; values already read
            may have been filled in.
        CheckpointError: the checkpoint is missing or incomplete, lacks a key,
            holds a different shape, or reading failed on some rank; the
            message names the first offending key.
    """
    path = Path(checkpoint_id)
    resolved = _decided_on_rank0(lambda: _resolve_or_error(path, note=True), process_group)
    if planner is None:
        planner = _CheckingLoadPlanner(resolved, allow_partial_load=not strict)
    reader = storage_reader if storage_reader is not None else VerifyingReader(resolved)
    try:
        with quiet_single_process():
            dcp_load(
                state_dict,
                checkpoint_id=resolved,
                storage_reader=reader,
                planner=planner,
                process_group=process_group,
                no_dist=not _distributed(),
            )
    except (CheckpointException, dist.DistError) as exc:
        corrupt = first_corruption(exc)
        if corrupt is not None:
            # Every rank has every rank's failures: the same error, then rank 0's search.
            intact = broadcast_object(
                newest_intact_beside(Path(resolved)) if rank(process_group) == 0 else None,
                process_group,
            )
            raise corrupt.with_intact(intact) from exc
        raise _failure(exc, f"loading checkpoint {resolved} failed", "") from exc


def resolve_checkpoint(checkpoint_id: str | os.PathLike[str]) -> Path:
    """The complete checkpoint directory to read for ``checkpoint_id``.

    ``checkpoint_id`` itself when it holds ``.metadata``; the newest complete
    ``step-<N>`` directory in it when it holds those instead;
    ``<checkpoint_id>.old`` when only that exists (a save interrupted while
    swapping directories). The checkpoint's structure is checked against its
    checksums (not its data: :func:`verify_checkpoint` reads that).

    Raises:
        CorruptCheckpointError: its checksum file, ``.metadata`` or a data
            file's size differ from what the save wrote.
        CheckpointError: no complete checkpoint there; the message says what is.
    """
    resolved = _resolve_or_error(Path(checkpoint_id), note=False)
    if isinstance(resolved, CheckpointError):
        raise resolved
    return Path(resolved)


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify_checkpoint` read.

    Attributes:
        path: The checkpoint directory verified.
        checksummed: Whether it has checksums; ``False`` for one written by
            PyTorch's DCP, of which nothing could be verified.
        files: The files checked against their checksums, ``.metadata``
            included (0 when not ``checksummed``).
        bytes: Their total size.
    """

    path: Path
    checksummed: bool
    files: int
    bytes: int


def verify_checkpoint(checkpoint_id: str | os.PathLike[str]) -> VerifyReport:
    """Read every file of the checkpoint at ``checkpoint_id`` and check it against its checksums.

    One process, no process group. ``checkpoint_id`` resolves as in
    :func:`resolve_checkpoint`.

    Raises:
        CorruptCheckpointError: the first difference, naming the file, the
            rank that wrote it, the key, and the newest intact checkpoint
            beside it.
        CheckpointError: no complete checkpoint there.
    """
    path = resolve_checkpoint(checkpoint_id)
    try:
        checked = verify(str(path), DirectorySource(path))
    except CorruptCheckpointError as exc:
        raise exc.with_intact(newest_intact_beside(path)) from None
    manifest = checked.manifest
    if manifest is None:
        return VerifyReport(path=path, checksummed=False, files=0, bytes=0)
    return VerifyReport(
        path=path,
        checksummed=True,
        files=len(manifest.files),
        bytes=sum(entry.size for entry in manifest.files.values()),
    )


def newest_intact_beside(path: Path) -> str | None:
    """The newest checkpoint beside ``path`` that verifies completely, as a string; ``None``."""
    intact = newest_intact_checkpoint(path.parent, besides=path)
    return None if intact is None else str(intact)


# ------------------------------------------------------------------ ranks


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _decided_on_rank0(
    decide: Callable[[], str | CheckpointError], process_group: dist.ProcessGroup | None
) -> str:
    """Rank 0's answer (a directory) on every rank, or its error raised on every rank.

    Only rank 0 looks at the file system, so the ranks cannot disagree about
    what is there (a shared directory another rank sees a moment later).
    """
    answer = broadcast_object(decide() if rank(process_group) == 0 else None, process_group)
    if isinstance(answer, CheckpointError):
        raise answer
    assert isinstance(answer, str)
    return answer


# ------------------------------------------------------------------ save steps


def _prepare_save(path: Path) -> str | CheckpointError:
    """Rank 0: check ``path`` can take a checkpoint; create and name the staging directory."""
    if path.exists() and not path.is_dir():
        return CheckpointError(
            f"cannot save a checkpoint at {path}: it is a file; pass a directory path as "
            "checkpoint_id"
        )
    if path.is_dir() and not (path / METADATA_FILE).is_file() and any(path.iterdir()):
        return CheckpointError(
            f"cannot save a checkpoint at {path}: the directory exists and is not a checkpoint "
            f"(it has files but no {METADATA_FILE}), and saving would replace it; choose "
            "another checkpoint_id or remove the directory"
        )
    staging = path.with_name(f"{path.name}{INCOMPLETE_MARK}{uuid.uuid4().hex[:12]}")
    try:
        staging.mkdir(parents=True)
    except OSError as exc:
        return CheckpointError(
            f"cannot save a checkpoint at {path}: creating {staging.name} next to it failed "
            f"({exc}); {_os_error_fix(exc, path)}"
        )
    return str(staging)


def _written_files(
    writer: StorageWriter, metadata: Metadata, staging: Path, *, verify: bool, group_rank: int
) -> tuple[dict[str, FileChecksums] | None, CorruptCheckpointError | None]:
    """This rank's files and their checksums, and (``verify``) what did not read back as written.

    ``None`` files: the writer was the caller's, which records no checksums.
    """
    if not isinstance(writer, ChecksummingWriter):
        return None, None
    files = {
        name: dataclasses.replace(entry, rank=group_rank)
        for name, entry in writer.written().items()
    }
    if not verify:
        return files, None
    checked = Checked(metadata=metadata, manifest=Manifest(files=files))
    try:
        check_segments(
            str(staging),
            DirectorySource(staging, uncached=True),
            checked,
            {name: entry.segments for name, entry in files.items()},
        )
    except CorruptCheckpointError as exc:
        return files, exc
    return files, None


def _unverified(
    everyone: list[tuple[dict[str, FileChecksums] | None, CorruptCheckpointError | None]],
    path: Path,
    staging: Path,
) -> str | None:
    """Rank 0: the error of a save whose files did not all read back as written, if any."""
    for _, problem in everyone:
        if problem is not None:
            return (
                f"saving checkpoint {path} failed: {problem.file} (written by rank "
                f"{problem.rank}) {problem.problem}{problem.location()} when read back right "
                "after it was written, so the storage did not keep the bytes it was given; the "
                f"previous checkpoint at {path} (if any) is untouched and loads as before; the "
                f"files written are left in {staging}"
            )
    return None


def _write_checksums(
    staging: Path,
    everyone: list[tuple[dict[str, FileChecksums] | None, CorruptCheckpointError | None]],
) -> None:
    """Rank 0: write ``.checksums`` for every rank's files and the ``.metadata``, durably."""
    if any(files is None for files, _ in everyone):
        return
    merged: dict[str, FileChecksums] = {}
    for files, _ in everyone:
        assert files is not None
        merged.update(files)
    merged[METADATA_FILE] = file_checksums(staging / METADATA_FILE, rank=0)
    with (staging / CHECKSUMS_FILE).open("wb") as file:
        file.write(encode_manifest(Manifest(files=merged)))
        file.flush()
        os.fsync(file.fileno())
    # The staging directory itself is not synced, as DCP does not sync it for its own
    # files: the swap syncs the parent. A file system that loses the entry anyway leaves a
    # checkpoint whose .metadata asks for checksums it lacks: refused, never loaded.


def _swap(staging: Path, path: Path) -> None:
    """Rank 0: put the complete ``staging`` in place of ``path``; see [Note: atomic checkpoints]."""
    old = path.with_name(path.name + OLD_SUFFIX)
    if path.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(path, old)
    os.replace(staging, path)
    _fsync_directory(path.parent)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


def _fsync_directory(directory: Path) -> None:
    """Make renames in ``directory`` durable where the platform allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ load checks


def _resolve_or_error(path: Path, *, note: bool) -> str | CheckpointError:
    """The checkpoint directory to read for ``path``, or the error to raise (rank 0).

    ``note``: log that a checkpoint without checksums is read unverified.
    """
    if not (path / METADATA_FILE).is_file() and (latest := latest_checkpoint(path)) is not None:
        _log.info("shard.checkpoint: reading %s, the newest step checkpoint in %s", latest, path)
        path = latest
    if (path / METADATA_FILE).is_file():
        return _checked_structure(path, note=note)
    old = path.with_name(path.name + OLD_SUFFIX)
    if not path.exists() and (old / METADATA_FILE).is_file():
        _log.warning(
            "shard.checkpoint: %s is missing but %s is complete (a save was interrupted while "
            "swapping directories); loading %s",
            path,
            old,
            old,
        )
        return _checked_structure(old, note=note)
    if INCOMPLETE_MARK in path.name:
        intended = path.name.split(INCOMPLETE_MARK)[0]
        return CheckpointError(
            f"{path} is an incomplete checkpoint: a save that did not finish left it; load "
            f"the last complete checkpoint, {path.with_name(intended)}"
        )
    unfinished = sorted(p.name for p in path.parent.glob(f"{path.name}{INCOMPLETE_MARK}*"))
    note_text = f" (a save to it did not finish: {unfinished[0]})" if unfinished else ""
    unfinished_steps = sorted(p.name for p in path.glob(f"{STEP_PREFIX}*{INCOMPLETE_MARK}*"))
    if unfinished_steps and not unfinished:
        note_text = f" (it holds only unfinished step saves: {', '.join(unfinished_steps)})"
    if not path.exists():
        return CheckpointError(f"no checkpoint at {path}: the path does not exist{note_text}")
    return CheckpointError(
        f"{path} is not a complete checkpoint: it has no {METADATA_FILE}, which a save writes "
        f"last{note_text}; load a checkpoint written by save()"
    )


def _checked_structure(path: Path, *, note: bool) -> str | CheckpointError:
    """``path``, or the error to raise when its files do not match their checksums.

    See [Note: what is verified when]. A damaged ``.metadata`` is reported
    here: DCP would otherwise log two tracebacks and fail with an assertion
    about a per-rank metadata file that never existed.
    """
    try:
        with quiet_single_process():
            checked = check_structure(str(path), DirectorySource(path))
    except CorruptCheckpointError as exc:
        return exc.with_intact(newest_intact_beside(path))
    except CheckpointError as exc:
        return exc
    if checked.manifest is None and note:
        _log.warning(
            "shard.checkpoint: %s has no checksums (written by PyTorch's "
            "torch.distributed.checkpoint, or before shard-checkpoint wrote them); loading it "
            "without verifying its bytes",
            path,
        )
    return str(path)


class _CheckingLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, after checking keys, shapes and data files.

    Every rank checks the same keys against the same metadata, so every rank
    raises the same error (DCP then reports it from all ranks at once).
    """

    def __init__(self, checkpoint: str, *, allow_partial_load: bool) -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        self._checkpoint = checkpoint

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        check_against_metadata(
            self.state_dict,
            self.metadata,
            self._checkpoint,
            strict=not self.allow_partial_load,
        )
        return super().create_local_plan()


def check_against_metadata(
    state_dict: Mapping[str, Any], metadata: Metadata, checkpoint: str, *, strict: bool
) -> None:
    """Raise ``CheckpointError`` for the first key of the flat ``state_dict`` that cannot load."""
    entries = metadata.state_dict_metadata
    data_files = _data_files(metadata)
    sizes: dict[str, int | None] = {}
    for key, value in state_dict.items():
        entry = entries.get(key)
        if entry is None:
            if not strict:
                continue
            close = difflib.get_close_matches(key, list(entries), n=1)
            hint = f" (closest: {close[0]!r})" if close else ""
            raise CheckpointError(
                f"checkpoint {checkpoint} has no {key!r}{hint}; it holds {len(entries)} keys. "
                "Load a checkpoint of this model, or pass strict=False to load the keys it has"
            )
        if isinstance(value, torch.Tensor):
            if not isinstance(entry, TensorStorageMetadata):
                raise CheckpointError(
                    f"checkpoint {checkpoint} holds a non-tensor object for {key!r}, but the "
                    f"state dict expects a tensor of shape {tuple(value.shape)}"
                )
            if tuple(entry.size) != tuple(value.shape):
                raise CheckpointError(
                    f"checkpoint {checkpoint} holds {key!r} with shape {tuple(entry.size)}, "
                    f"but the state dict expects {tuple(value.shape)}; load a checkpoint of "
                    "this model (the shapes saved are the full, unsharded ones)"
                )
        for relative_path, end in data_files.get(key, ()):
            if relative_path not in sizes:
                try:
                    sizes[relative_path] = os.stat(Path(checkpoint) / relative_path).st_size
                except OSError:
                    sizes[relative_path] = None
            size = sizes[relative_path]
            if size is None or size < end:
                found = "is missing" if size is None else f"has only {size} bytes"
                raise CheckpointError(
                    f"checkpoint {checkpoint} is incomplete: the data of {key!r} is in "
                    f"{relative_path}, which {found} (needs {end}); the checkpoint was "
                    "damaged after it was written (a file deleted or cut short)"
                )


def _data_files(metadata: Metadata) -> dict[str, list[tuple[str, int]]]:
    """Per key, the files (relative to the checkpoint) and end offsets of its saved chunks."""
    files: dict[str, list[tuple[str, int]]] = {}
    storage = metadata.storage_data
    if not isinstance(storage, Mapping):
        return files
    for index, info in storage.items():
        relative_path = getattr(info, "relative_path", None)
        offset = getattr(info, "offset", None)
        length = getattr(info, "length", None)
        fqn = getattr(index, "fqn", None)
        if (
            isinstance(relative_path, str)
            and isinstance(fqn, str)
            and isinstance(offset, int)
            and isinstance(length, int)
        ):
            files.setdefault(fqn, []).append((relative_path, offset + length))
    return files


# ------------------------------------------------------------------ errors


def _save_failure(
    exc: CheckpointException | dist.DistError,
    path: Path,
    staging: Path,
    process_group: dist.ProcessGroup | None,
) -> Exception:
    """The error of a failed save: what failed, how to fix it, and that ``path`` is intact.

    A full disk is made no worse: the staging directory is removed (every
    rank is past DCP's last collective when the failure is raised, so no rank
    writes there any more). Otherwise it stays, for the post-mortem.
    """
    cause = _first_cause(exc)
    previous = f"the previous checkpoint at {path} (if any) is untouched and loads as before"
    if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
        if rank(process_group) == 0:
            shutil.rmtree(staging, ignore_errors=True)
        kept = f"the partial files were removed ({staging.name})"
    else:
        kept = f"the files written are left in {staging}"
    fix = f"; {_os_error_fix(cause, path)}" if isinstance(cause, OSError) else ""
    return _failure(exc, f"saving checkpoint {path} failed", f"{previous}; {kept}{fix}")


def _first_cause(exc: CheckpointException | dist.DistError) -> BaseException:
    if isinstance(exc, CheckpointException) and exc.failures:
        first = exc.failures[min(exc.failures)][0]
        if isinstance(first, BaseException):
            return first
    return exc


def _os_error_fix(exc: OSError, path: Path) -> str:
    """What to do about an ``OSError`` met while writing a checkpoint at ``path``."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"the disk holding {path.parent} is full: free space there (old checkpoints, "
            "leftover *.incomplete-* directories) or pass a checkpoint_id on another disk"
        )
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (
            f"this process cannot write to {path.parent}: make it writable for the user "
            "running the job (on every node) or pass a checkpoint_id in a writable directory"
        )
    if exc.errno in (errno.ENOTDIR, errno.ENOENT):
        return f"a component of {path.parent} is not a directory: pass a directory path"
    return "check the file system at that path (the error above), or save elsewhere"


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().split("\n", 1)[0]


def first_corruption(exc: CheckpointException | dist.DistError) -> CorruptCheckpointError | None:
    """The lowest rank's ``CorruptCheckpointError`` among a failed load's failures, if any."""
    if not isinstance(exc, CheckpointException):
        return None
    for failing_rank in sorted(exc.failures):
        failure = exc.failures[failing_rank][0]
        if isinstance(failure, CorruptCheckpointError):
            return failure
    return None


def _failure(exc: CheckpointException | dist.DistError, what: str, after: str) -> Exception:
    """One exception for a failed save or load: DCP reports the same failures on every rank."""
    tail = f"; {after}" if after else ""
    if not isinstance(exc, CheckpointException):
        return CheckpointError(f"{what}: {type(exc).__name__}: {exc}{tail}")
    failures = exc.failures
    first = failures[min(failures)][0]
    if isinstance(first, CheckpointError | StateDictError):
        return type(first)(str(first))
    ranks = ", ".join(str(r) for r in sorted(failures))
    plural = "s" if len(failures) > 1 else ""
    if isinstance(first, pickle.UnpicklingError | EOFError) or "PytorchStreamReader" in str(first):
        # A data file that no longer decodes; torch.load's own advice (weights_only)
        # would mislead here.
        return CheckpointError(
            f"{what} on rank{plural} {ranks}: a data file of the checkpoint is damaged "
            f"({type(first).__name__} while decoding it); it was overwritten or cut short "
            "after the save completed. Load an earlier checkpoint, or save this one again"
        )
    return CheckpointError(f"{what} on rank{plural} {ranks}: {type(first).__name__}: {first}{tail}")


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process: here that is asked for."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield
