"""A ``torch.save`` file written one tensor at a time.

``torch.save`` pickles the whole object first and then writes every
storage, so it needs every tensor in memory at once. Here the file is laid
out by ``torch.save`` itself from placeholder tensors under
``torch.serialization.skip_data``, which reserves each storage's bytes
without reading or writing them; then each real tensor is written into its
reserved bytes and dropped. The placeholders are ``torch.empty`` tensors
that are never touched, so they take address space but no resident memory
(large allocations are fresh zero pages that the OS only backs on use).
The result is an ordinary ``torch.save`` zip file: ``torch.load`` (with or
without ``mmap``) reads it.

[Note: storage records]
``torch.save`` names storages ``data/0``, ``data/1``, ... in the order the
pickler meets them, which for a flat dict of distinct tensors is the dict's
order; the record sizes are checked against the tensors' sizes before
anything is written. The zip entries carry CRC-32 checksums that
``skip_data`` leaves at zero; they are filled in as the data is written (in
each entry's data descriptor and in the central directory), so zip tools
find the file sound too.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from shard_checkpoint._errors import CheckpointError
from shard_checkpoint._safetensors import as_bytes

__all__ = ["TensorPlaceholder", "write_torch_file"]

_LOCAL_HEADER = b"PK\x03\x04"
_CENTRAL_HEADER = b"PK\x01\x02"
_DESCRIPTOR = b"PK\x07\x08"
_HAS_DESCRIPTOR = 0x08


class TensorPlaceholder:
    """A tensor to come: its shape and dtype."""

    __slots__ = ("dtype", "shape")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape = shape
        self.dtype = dtype


def write_torch_file(
    path: str | os.PathLike[str],
    layout: Mapping[str, TensorPlaceholder | Any],
    produce: Callable[[str], torch.Tensor],
) -> None:
    """Write ``{name: value}`` as ``torch.save`` would, asking ``produce(name)`` per tensor.

    ``layout`` holds a :class:`TensorPlaceholder` for each tensor and the
    value itself for anything else. See [Note: storage records].
    """
    names = [name for name, value in layout.items() if isinstance(value, TensorPlaceholder)]
    skeleton = {
        name: torch.empty(value.shape, dtype=value.dtype)
        if isinstance(value, TensorPlaceholder)
        else value
        for name, value in layout.items()
    }
    with torch.serialization.skip_data():
        torch.save(skeleton, path)
    del skeleton
    records = _storage_records(path)
    if len(records) != len(names):
        raise CheckpointError(
            f"{path}: torch.save laid out {len(records)} storages for {len(names)} tensors"
        )
    crcs: dict[str, int] = {}
    with open(path, "r+b") as file:
        for index, name in enumerate(names):
            info = records[index]
            placeholder = layout[name]
            nbytes = _numel(placeholder.shape) * placeholder.dtype.itemsize
            if info.file_size != nbytes:
                raise CheckpointError(
                    f"{path}: storage record {info.filename} has {info.file_size} bytes, "
                    f"{name!r} needs {nbytes}"
                )
            tensor = produce(name)
            if tuple(tensor.shape) != placeholder.shape or tensor.dtype != placeholder.dtype:
                raise CheckpointError(
                    f"{name!r}: expected a {placeholder.dtype} tensor of shape "
                    f"{placeholder.shape}, got {tensor.dtype} of shape {tuple(tensor.shape)}"
                )
            data = as_bytes(tensor.detach().cpu().contiguous())
            start = _data_start(file, info)
            file.seek(start)
            file.write(data)
            crc = zlib.crc32(data)
            crcs[info.filename] = crc
            _patch_local_crc(file, info, start, crc)
            del tensor, data
        _patch_central_crcs(file, path, crcs)


def _storage_records(path: str | os.PathLike[str]) -> list[zipfile.ZipInfo]:
    """The ``<archive>/data/<n>`` entries, indexed by ``n``."""
    by_index: dict[int, zipfile.ZipInfo] = {}
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            parts = info.filename.split("/")
            if len(parts) == 3 and parts[1] == "data" and parts[2].isdigit():
                by_index[int(parts[2])] = info
    return [by_index[i] for i in sorted(by_index)]


def _data_start(file: Any, info: zipfile.ZipInfo) -> int:
    file.seek(info.header_offset)
    header = file.read(30)
    if header[:4] != _LOCAL_HEADER:
        raise CheckpointError(f"{info.filename}: no zip local header at {info.header_offset}")
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return int(info.header_offset + 30 + name_length + extra_length)


def _patch_local_crc(file: Any, info: zipfile.ZipInfo, start: int, crc: int) -> None:
    """Write ``crc`` where the entry's local record keeps it (header or data descriptor)."""
    if info.flag_bits & _HAS_DESCRIPTOR:
        position = start + info.file_size
        file.seek(position)
        if file.read(4) == _DESCRIPTOR:
            position += 4
        file.seek(position)
    else:
        file.seek(info.header_offset + 14)
    file.write(struct.pack("<I", crc))


def _patch_central_crcs(file: Any, path: str | os.PathLike[str], crcs: Mapping[str, int]) -> None:
    with zipfile.ZipFile(path) as archive:
        position = archive.start_dir
        count = len(archive.infolist())
    for _ in range(count):
        file.seek(position)
        entry = file.read(46)
        if entry[:4] != _CENTRAL_HEADER:
            raise CheckpointError(f"{path}: no zip central directory entry at {position}")
        name_length, extra_length, comment_length = struct.unpack("<HHH", entry[28:34])
        name = file.read(name_length).decode()
        if name in crcs:
            file.seek(position + 16)
            file.write(struct.pack("<I", crcs[name]))
        position += 46 + name_length + extra_length + comment_length


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel
