"""Checkpoints checked against their checksums: when loaded, on demand, and before a save is kept.

See [Note: checkpoint checksums] in ``_checksums.py`` for what a save
records; this module writes it (:class:`ChecksummingWriter`, a DCP
``FileSystemWriter``) and checks it.

[Note: what is verified when]
- ``load``: rank 0 first checks the checkpoint's structure (the checksum
  file's own checksum, the ``.metadata``'s checksum, every data file present
  with the size the save wrote, every data file the ``.metadata`` names
  covered) before any rank reads; then each rank, in
  :class:`VerifyingReader`, checks the segments holding the items it is
  about to read, before DCP decodes them. Every byte a load uses is checked
  once; the keys a partial load (``strict=False``) skips are neither read
  nor checked.
- :func:`verify`: the structure and every segment of every file
  (``verify_checkpoint``, ``shard ckpt inspect --verify``, the search for
  the newest intact checkpoint, and ``save(verify=True)``, where each rank
  reads back the files it wrote, from the storage rather than the page
  cache where the OS allows: the checksums were taken of the bytes on their
  way to the file, so a read of the same cached pages would prove little).
- A checkpoint with neither a ``.checksums`` file nor the mark in its
  ``.metadata`` (written by PyTorch's DCP, or by shard-checkpoint before
  checksums) loads unverified, and ``load`` logs a warning saying so.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
from collections.abc import Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from shard_checkpoint._checksums import (
    CHECKSUMS_FILE,
    CHECKSUMS_MARK,
    FileChecksums,
    FileRecorder,
    Manifest,
    ManifestError,
    Segment,
    checksum,
    decode_manifest,
    open_checksummed,
    segments_of,
)
from shard_checkpoint._errors import CheckpointError, CorruptCheckpointError

__all__ = [
    "METADATA_FILE",
    "Checked",
    "ChecksummingWriter",
    "DirectorySource",
    "MemorySource",
    "Source",
    "VerifyingReader",
    "check_segments",
    "check_structure",
    "has_checksums_mark",
    "verify",
]

_log = logging.getLogger("shard.checkpoint")

METADATA_FILE = ".metadata"
_MISMATCH = "does not match its checksum"


# ------------------------------------------------------------------ where the bytes are


class Source(Protocol):
    """The files of one checkpoint: a directory, or (in tests) bytes in memory."""

    def size(self, name: str) -> int | None:
        """The size of file ``name``; ``None`` if it does not exist."""

    def open(self, name: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        """File ``name``, open for reading."""


class DirectorySource:
    """The files of the checkpoint directory ``path``.

    ``uncached``: drop each file's pages from the OS's cache before reading
    it (``posix_fadvise``, where there is one), so that what is read comes
    from the storage, not from the memory the writer just filled.
    """

    def __init__(self, path: str | os.PathLike[str], *, uncached: bool = False) -> None:
        self.path = Path(path)
        self.uncached = uncached

    def size(self, name: str) -> int | None:
        try:
            return os.stat(self.path / name).st_size
        except OSError:
            return None

    def open(self, name: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        file = (self.path / name).open("rb")
        if self.uncached and hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):
                os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return file


class MemorySource:
    """Checkpoint files held as bytes (a test damages them without touching a disk)."""

    def __init__(self, files: Mapping[str, bytes]) -> None:
        self.files = files

    def size(self, name: str) -> int | None:
        data = self.files.get(name)
        return None if data is None else len(data)

    @contextlib.contextmanager
    def open(self, name: str) -> Generator[IO[bytes], None, None]:
        if name not in self.files:
            raise FileNotFoundError(name)
        yield io.BytesIO(self.files[name])


def _read_all(source: Source, name: str) -> bytes | None:
    try:
        with source.open(name) as file:
            return file.read()
    except FileNotFoundError:
        return None


# ------------------------------------------------------------------ checks


@dataclass(frozen=True)
class Checked:
    """A checkpoint whose structure passed :func:`check_structure`.

    Attributes:
        metadata: Its decoded ``.metadata``.
        manifest: Its checksums; ``None`` for a checkpoint that has none
            (written by PyTorch's DCP), which is not verified.
    """

    metadata: Metadata
    manifest: Manifest | None


def has_checksums_mark(metadata: Metadata) -> bool:
    """Whether ``metadata`` says its save wrote a ``.checksums`` file."""
    meta = getattr(metadata, "storage_meta", None)
    return CHECKSUMS_MARK in (getattr(meta, "modules", None) or ())


def check_structure(checkpoint: str, source: Source) -> Checked:
    """Check ``checkpoint``'s files without reading its data; see [Note: what is verified when].

    Raises:
        CorruptCheckpointError: the checksum file is damaged or missing, the
            ``.metadata`` fails its checksum, or a data file is missing, has
            another size than the save wrote, or has no checksums.
        CheckpointError: no ``.metadata``, or (without checksums) one that
            does not decode.
    """
    manifest = _read_manifest(checkpoint, source)
    raw = _read_all(source, METADATA_FILE)
    if raw is None:
        raise CheckpointError(
            f"{checkpoint} is not a complete checkpoint: it has no {METADATA_FILE}, which a save "
            "writes last; load a checkpoint written by save()"
        )
    if manifest is not None:
        _check_whole(checkpoint, manifest, METADATA_FILE, raw)
    try:
        metadata = pickle.loads(raw)
        if not isinstance(metadata, Metadata):
            raise TypeError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    except Exception as exc:  # any decoding failure means a damaged file
        raise CheckpointError(
            f"checkpoint {checkpoint} is damaged: its {METADATA_FILE} cannot be read "
            f"({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}); "
            "the file was cut short or overwritten after the save completed. Load an earlier "
            "checkpoint, or save this one again"
        ) from None
    if manifest is None:
        if has_checksums_mark(metadata):
            raise _missing_manifest(checkpoint)
        return Checked(metadata=metadata, manifest=None)
    _check_files(checkpoint, source, manifest, metadata)
    return Checked(metadata=metadata, manifest=manifest)


def _read_manifest(checkpoint: str, source: Source) -> Manifest | None:
    """The decoded ``.checksums`` of ``checkpoint``; ``None`` when it has none.

    Raises:
        CorruptCheckpointError: the file is there but does not decode or fails its own checksum.
    """
    encoded = _read_all(source, CHECKSUMS_FILE)
    if encoded is None:
        return None
    try:
        return decode_manifest(encoded)
    except ManifestError as exc:
        raise CorruptCheckpointError(
            checkpoint=checkpoint, file=CHECKSUMS_FILE, rank=0, problem=f"is damaged ({exc})"
        ) from None


def _missing_manifest(checkpoint: str) -> CorruptCheckpointError:
    """The error for a checkpoint whose ``.metadata`` has the mark but no ``.checksums``."""
    return CorruptCheckpointError(
        checkpoint=checkpoint,
        file=CHECKSUMS_FILE,
        rank=0,
        problem=f"is missing (its {METADATA_FILE} says the save wrote one)",
    )


def _check_whole(checkpoint: str, manifest: Manifest, name: str, data: bytes) -> None:
    """Check a file read whole (``.metadata``) against its entry in ``manifest``."""
    entry = manifest.files.get(name)
    if entry is None:
        raise CorruptCheckpointError(
            checkpoint=checkpoint,
            file=CHECKSUMS_FILE,
            rank=0,
            problem=f"is damaged (it has no checksums of {name})",
        )
    if len(data) != entry.size:
        raise CorruptCheckpointError(
            checkpoint=checkpoint,
            file=name,
            rank=entry.rank,
            problem=f"has {len(data)} bytes where the save wrote {entry.size}",
        )
    for offset, length, crc in entry.segments:
        if checksum(memoryview(data)[offset : offset + length]) != crc:
            raise CorruptCheckpointError(
                checkpoint=checkpoint,
                file=name,
                rank=entry.rank,
                problem=_MISMATCH,
                byte_range=(offset, offset + length),
            )


def _check_files(checkpoint: str, source: Source, manifest: Manifest, metadata: Metadata) -> None:
    """Every file the checksums list has its size; every data file has checksums."""
    for name, entry in sorted(manifest.files.items()):
        if name == METADATA_FILE:
            continue
        size = source.size(name)
        if size == entry.size:
            continue
        lost = 0 if size is None else size
        key, offsets = _key_at(metadata, name, lost, max(entry.size, lost + 1))
        raise CorruptCheckpointError(
            checkpoint=checkpoint,
            file=name,
            rank=entry.rank,
            problem="is missing"
            if size is None
            else f"has {size} bytes where the save wrote {entry.size}",
            key=key,
            offsets=offsets,
        )
    for name in sorted(_data_files(metadata)):
        if name not in manifest.files:
            key, offsets = _key_at(metadata, name, 0, 2**63)
            raise CorruptCheckpointError(
                checkpoint=checkpoint,
                file=name,
                problem=f"has no checksums in {CHECKSUMS_FILE}",
                key=key,
                offsets=offsets,
            )


def check_segments(
    checkpoint: str,
    source: Source,
    checked: Checked,
    wanted: Mapping[str, Iterable[Segment]],
) -> None:
    """Read the segments ``wanted`` (by file) and compare them with their checksums.

    Raises:
        CorruptCheckpointError: the first segment that differs, or a file
            that is missing or shorter than its checksums say.
    """
    for name, segments in sorted(wanted.items()):
        entry = _entry(checked, name)
        try:
            with source.open(name) as file:
                for offset, length, crc in sorted(set(segments)):
                    file.seek(offset)
                    data = file.read(length)
                    if len(data) == length and checksum(data) == crc:
                        continue
                    if len(data) != length:
                        problem = (
                            f"has {offset + len(data)} bytes where the save wrote {entry.size}"
                        )
                    else:
                        problem = _MISMATCH
                    key, offsets = _key_at(checked.metadata, name, offset, offset + length)
                    raise CorruptCheckpointError(
                        checkpoint=checkpoint,
                        file=name,
                        rank=entry.rank,
                        problem=problem,
                        key=key,
                        offsets=offsets,
                        byte_range=(offset, offset + length) if problem == _MISMATCH else None,
                    )
        except FileNotFoundError:
            key, offsets = _key_at(checked.metadata, name, 0, 2**63)
            raise CorruptCheckpointError(
                checkpoint=checkpoint,
                file=name,
                rank=entry.rank,
                problem="is missing",
                key=key,
                offsets=offsets,
            ) from None


def _entry(checked: Checked, name: str) -> FileChecksums:
    assert checked.manifest is not None
    return checked.manifest.files[name]


def verify(checkpoint: str, source: Source) -> Checked:
    """Check ``checkpoint``'s structure and every segment of every file.

    Raises:
        CorruptCheckpointError: the first difference found.
        CheckpointError: not a complete checkpoint.
    """
    checked = check_structure(checkpoint, source)
    if checked.manifest is not None:
        wanted = {
            name: entry.segments
            for name, entry in checked.manifest.files.items()
            if name != METADATA_FILE
        }
        check_segments(checkpoint, source, checked, wanted)
    return checked


def _data_files(metadata: Metadata) -> set[str]:
    storage = metadata.storage_data
    if not isinstance(storage, Mapping):
        return set()
    return {
        path
        for info in storage.values()
        if isinstance(path := getattr(info, "relative_path", None), str)
    }


def _stored_items(
    metadata: Metadata,
) -> Iterator[tuple[str, tuple[int, ...] | None, str, int, int]]:
    """``(key, chunk offsets, file, start, end)`` of every saved item."""
    storage = metadata.storage_data
    if not isinstance(storage, Mapping):
        return
    for index, info in storage.items():
        relative_path = getattr(info, "relative_path", None)
        offset = getattr(info, "offset", None)
        length = getattr(info, "length", None)
        fqn = getattr(index, "fqn", None)
        if not (
            isinstance(relative_path, str)
            and isinstance(fqn, str)
            and isinstance(offset, int)
            and isinstance(length, int)
        ):
            continue
        chunk = getattr(index, "offset", None)
        yield (
            fqn,
            None if chunk is None else tuple(int(d) for d in chunk),
            relative_path,
            offset,
            (offset + length),
        )


def _key_at(
    metadata: Metadata, name: str, start: int, end: int
) -> tuple[str | None, tuple[int, ...] | None]:
    """The key (and chunk offsets) of the first item of file ``name`` within ``[start, end)``."""
    found = [
        (item_start, key, offsets)
        for key, offsets, path, item_start, item_end in _stored_items(metadata)
        if path == name and item_start < end and start < item_end
    ]
    if not found:
        return None, None
    _, key, offsets = min(found, key=lambda item: item[0])
    return key, offsets


# ------------------------------------------------------------------ DCP storage


class _ChecksummingFileSystem(FileSystem):
    """DCP's local file system, checksumming every file opened for writing."""

    def __init__(self, recorder: FileRecorder) -> None:
        super().__init__()
        self._recorder = recorder

    @contextlib.contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream, checksummed = open_checksummed(Path(path))
        with stream:
            yield stream
        self._recorder.record(Path(path), checksummed, rank=None)


class ChecksummingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter``, recording the checksums of the files it writes.

    See [Note: checkpoint checksums]: :meth:`written` holds them once
    ``write_data`` is done; ``save`` collects every rank's and writes the
    ``.checksums`` file. The ``.metadata`` carries the mark that the
    checkpoint has one.
    """

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._recorder = FileRecorder()
        self.fs = _ChecksummingFileSystem(self._recorder)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        self._recorder.clear()

    def storage_meta(self) -> StorageMeta | None:
        meta = super().storage_meta() or StorageMeta()
        meta.modules = [*meta.modules, CHECKSUMS_MARK]
        return meta

    def written(self) -> dict[str, FileChecksums]:
        """The checksums of the data files this rank wrote, by name."""
        return {
            name: entry
            for name, entry in self._recorder.files().items()
            if not name.startswith(METADATA_FILE)
        }


class VerifyingReader(FileSystemReader):
    """DCP's ``FileSystemReader``, checking each item's bytes before it decodes them.

    See [Note: what is verified when]: this is the per-rank half. A
    checkpoint without checksums (and without the mark) is read as DCP
    reads it.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self._checked: Checked | None = None

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        if self._checked is not None and self._checked.metadata is metadata:
            return  # a reader that loads one checkpoint in parts (consolidate)
        checkpoint = str(self.path)
        manifest = _read_manifest(checkpoint, DirectorySource(checkpoint))
        if manifest is None and has_checksums_mark(metadata):
            raise _missing_manifest(checkpoint)
        self._checked = Checked(metadata=metadata, manifest=manifest)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        checked = self._checked
        if checked is not None and checked.manifest is not None:
            wanted: dict[str, set[Segment]] = {}
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                name = info.relative_path
                entry = checked.manifest.files.get(name)
                if entry is None:
                    raise CorruptCheckpointError(
                        checkpoint=str(self.path),
                        file=name,
                        problem=f"has no checksums in {CHECKSUMS_FILE}",
                        key=item.storage_index.fqn,
                    )
                wanted.setdefault(name, set()).update(
                    segments_of(entry, info.offset, info.offset + info.length)
                )
            check_segments(str(self.path), DirectorySource(self.path), checked, wanted)
        return super().read_data(plan, planner)
