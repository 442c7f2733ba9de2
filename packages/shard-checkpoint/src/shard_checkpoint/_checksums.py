"""Checksums of checkpoint files: computed while DCP writes them, kept in one file beside them.

[Note: checkpoint checksums]
A save records, for every file it writes, CRC-32C checksums of consecutive
byte ranges ("segments") that tile the file from its first byte to its last.
The ranges are cut where DCP starts a new item (it asks the stream for its
position before and after each one), and every ``MAX_SEGMENT`` bytes within
a large item, so a failing range names one key, and reading a key back
needs only the segments that hold it. The checksums are computed from the
bytes on their way to the file (:class:`ChecksummingFile`), never by
reading the file again.

After every rank has written its files and rank 0 the ``.metadata``, rank 0
writes them all, the ``.metadata``'s too, as ``.checksums``: one line of
JSON, then a line holding the CRC-32C of that line, so a change to the
checksum file itself is detected like any other. Only then is the
checkpoint renamed into place ([Note: atomic checkpoints] in
``_storage.py``). The ``.metadata`` also says that the checkpoint has a
``.checksums`` (``storage_meta.modules`` holds :data:`CHECKSUMS_MARK`, a
field DCP does not read), so a deleted checksum file is an error rather
than a checkpoint that silently loads unverified. PyTorch's DCP reads these
checkpoints as it reads its own: it ignores the extra file and field.

CRC-32C because every single-bit error (and every burst of up to 32 bits)
in a segment is guaranteed to change it, and the ``crc32c`` package
computes it with the CPU's CRC instruction. Measured on this project's
machine (2 shared cores; ``tools/bench/bench_checkpoint.py --parts
checksums``): 21-31 GB/s on the demo model's tensor shards (16-128 KiB),
13-30 GB/s at 4-64 MiB, against 1.5-5.7 GB/s for ``zlib.crc32``; one rank's
shards of the demo model take 0.15 ms (``zlib.crc32``: 0.7-1.4 ms).
``xxhash``'s xxh3 is about twice as fast again, but a hash: it guarantees
nothing about single bits.
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import crc32c

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

__all__ = [
    "ALGORITHM",
    "CHECKSUMS_FILE",
    "CHECKSUMS_MARK",
    "MAX_SEGMENT",
    "SMALL_WRITE",
    "ChecksummingFile",
    "FileChecksums",
    "FileRecorder",
    "Manifest",
    "ManifestError",
    "checksum",
    "decode_manifest",
    "encode_manifest",
    "file_checksums",
    "open_checksummed",
    "segments_of",
]

ALGORITHM = "crc32c"
CHECKSUMS_FILE = ".checksums"
CHECKSUMS_MARK = "shard_checkpoint.checksums/1"
_FORMAT = "shard-checkpoint-checksums"
_VERSION = 1
# A segment never spans more: a failing range stays small enough to name, and a
# key is verified without reading much beyond it.
MAX_SEGMENT = 16 * 1024 * 1024
# The buffer that gathers small writes before they are checksummed and written.
SMALL_WRITE = 64 * 1024

# (offset, length, crc) of one segment of a file.
Segment = tuple[int, int, int]


def checksum(data: ReadableBuffer, value: int = 0) -> int:
    """The CRC-32C of ``data``, continuing from ``value`` (the CRC of the bytes before it)."""
    return int(crc32c.crc32c(data, value))


@dataclass(frozen=True)
class FileChecksums:
    """The checksums of one file of a checkpoint.

    Attributes:
        name: The file's name, relative to the checkpoint directory.
        rank: The rank that wrote it; ``None`` for a file of the whole
            checkpoint (``.metadata``).
        size: Its size in bytes.
        segments: ``(offset, length, crc)`` of consecutive ranges covering
            ``[0, size)`` exactly (none for an empty file).
    """

    name: str
    rank: int | None
    size: int
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class Manifest:
    """Everything ``.checksums`` holds: the checksums of each file of the checkpoint.

    Attributes:
        files: By file name (relative to the checkpoint directory).
    """

    files: Mapping[str, FileChecksums]


class ManifestError(ValueError):
    """A ``.checksums`` file that cannot be decoded, or whose own checksum fails."""


def encode_manifest(manifest: Manifest) -> bytes:
    """The bytes of a ``.checksums`` file: one line of JSON, then its CRC-32C in hex."""
    body = json.dumps(
        {
            "format": _FORMAT,
            "version": _VERSION,
            "algorithm": ALGORITHM,
            "files": {
                name: {"rank": f.rank, "size": f.size, "segments": [list(s) for s in f.segments]}
                for name, f in sorted(manifest.files.items())
            },
        },
        separators=(",", ":"),
    ).encode("ascii")
    return body + b"\n" + f"{checksum(body):08x}".encode("ascii") + b"\n"


def decode_manifest(data: bytes) -> Manifest:
    """The manifest ``data`` encodes.

    Raises:
        ManifestError: ``data`` is not a whole ``.checksums`` file of this
            format, or its checksum line does not match its JSON line.
    """
    body, sep, rest = data.partition(b"\n")
    if not sep or len(rest) != 9 or not rest.endswith(b"\n"):
        raise ManifestError("it is not two lines (JSON, then its checksum)")
    try:
        recorded = int(rest[:8].decode("ascii"), 16)
    except ValueError:
        raise ManifestError("its checksum line is not 8 hex digits") from None
    if rest[:8] != f"{recorded:08x}".encode("ascii"):
        raise ManifestError("its checksum line is not 8 lowercase hex digits")
    if checksum(body) != recorded:
        raise ManifestError("its own checksum does not match its contents")
    try:
        decoded = json.loads(body.decode("ascii"))
        if decoded["format"] != _FORMAT or decoded["algorithm"] != ALGORITHM:
            raise ManifestError(f"it is not a {ALGORITHM} checksum file of shard-checkpoint")
        if decoded["version"] != _VERSION:
            raise ManifestError(
                f"it has version {decoded['version']}, this shard-checkpoint reads {_VERSION}; "
                "upgrade shard-checkpoint"
            )
        files = {
            str(name): FileChecksums(
                name=str(name),
                rank=None if entry["rank"] is None else int(entry["rank"]),
                size=int(entry["size"]),
                segments=tuple((int(o), int(n), int(c)) for o, n, c in entry["segments"]),
            )
            for name, entry in decoded["files"].items()
        }
    except ManifestError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise ManifestError(f"its contents do not decode ({type(exc).__name__})") from None
    for entry in files.values():
        if not _tiles(entry):
            raise ManifestError(f"its segments of {entry.name} do not cover the file")
    return Manifest(files=files)


def _tiles(entry: FileChecksums) -> bool:
    """Whether ``entry``'s segments cover ``[0, size)`` in order, without gaps or overlaps."""
    position = 0
    for offset, length, _ in entry.segments:
        if offset != position or length <= 0:
            return False
        position += length
    return position == entry.size


def segments_of(entry: FileChecksums, start: int, end: int) -> Iterator[Segment]:
    """The segments of ``entry`` that hold any byte of ``[start, end)``."""
    for segment in entry.segments:
        offset, length, _ = segment
        if offset < end and start < offset + length:
            yield segment


class ChecksummingFile(io.RawIOBase):
    """A file open for writing that checksums what it writes; see [Note: checkpoint checksums].

    Used as the raw file under an ``io.BufferedWriter`` (:func:`open_checksummed`):
    ``torch.save`` makes dozens of small writes per tensor (zip headers, the
    pickle), which the buffered writer gathers in C; this class sees one write
    per buffer flush, and large writes (tensor data) whole, without a copy.
    ``tell()`` closes the current segment: DCP asks for the position before and
    after each item it writes, right after flushing, so segments follow items.
    """

    def __init__(self, file: io.RawIOBase, *, max_segment: int = MAX_SEGMENT) -> None:
        super().__init__()
        self._file = file
        self._max_segment = max_segment
        # - the file so far
        self._position = 0
        self._segments: list[Segment] = []
        # - the open segment
        self._start = 0
        self._crc = 0

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The segments written so far (the open one closed first)."""
        self._cut()
        return tuple(self._segments)

    @property
    def size(self) -> int:
        return self._position

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, data: ReadableBuffer) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            room = self._max_segment - (self._position - self._start)
            piece = view[done : done + room]
            written = 0
            while written < len(piece):  # an unbuffered file may write less than asked
                count = self._file.write(piece[written:])
                if not count:
                    raise OSError(f"could not write to {self._file}")
                written += count
            self._crc = checksum(piece, self._crc)
            self._position += len(piece)
            done += len(piece)
            if self._position - self._start == self._max_segment:
                self._cut()
        return len(view)

    def tell(self) -> int:
        self._cut()
        return self._position

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        if not self.closed:
            self._cut()
            super().close()
            self._file.close()

    def _cut(self) -> None:
        if self._position > self._start:
            self._segments.append((self._start, self._position - self._start, self._crc))
            self._start, self._crc = self._position, 0


def open_checksummed(path: Path) -> tuple[io.BufferedWriter, ChecksummingFile]:
    """``path`` open for writing through a ``ChecksummingFile``: the stream, and that file."""
    raw = ChecksummingFile(io.FileIO(path, "wb"))
    return io.BufferedWriter(raw, buffer_size=SMALL_WRITE), raw


class FileRecorder:
    """The checksums of the files one writer wrote, collected from its threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[str, FileChecksums] = {}

    def record(self, path: Path, stream: ChecksummingFile, rank: int | None) -> None:
        entry = FileChecksums(name=path.name, rank=rank, size=stream.size, segments=stream.segments)
        with self._lock:
            self._files[path.name] = entry

    def clear(self) -> None:
        with self._lock:
            self._files.clear()

    def files(self) -> dict[str, FileChecksums]:
        with self._lock:
            return dict(self._files)


def file_checksums(
    path: Path, *, rank: int | None, max_segment: int = MAX_SEGMENT
) -> FileChecksums:
    """Checksum an existing file the way a save would have (one segment per ``max_segment``)."""
    segments: list[Segment] = []
    offset = 0
    with path.open("rb") as file:
        while block := file.read(max_segment):
            segments.append((offset, len(block), checksum(block)))
            offset += len(block)
    return FileChecksums(name=path.name, rank=rank, size=offset, segments=tuple(segments))
