"""The safetensors file format, written one tensor at a time.

The format: an 8-byte little-endian header length N, N bytes of JSON
(``{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
"__metadata__": {str: str}}``, padded with spaces to a multiple of 8), then
the tensors' raw little-endian bytes back to back, offsets relative to the
end of the header. Because the header only needs shapes and dtypes, a writer
can emit it first and then stream each tensor as it becomes available, which
the ``safetensors`` package's writers (whole dict in memory) cannot. The
reader exists for tests and for tools without the ``safetensors`` package.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import BinaryIO

import torch

from shard_checkpoint._errors import CheckpointError

__all__ = ["SAFETENSORS_DTYPES", "as_bytes", "read_safetensors", "write_safetensors"]

SAFETENSORS_DTYPES: Mapping[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH_DTYPES = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (valid while ``tensor`` lives)."""
    assert tensor.device.type == "cpu", tensor.device
    assert tensor.is_contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def write_safetensors(
    path: str | os.PathLike[str],
    specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
    produce: Callable[[str], torch.Tensor],
    *,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write a safetensors file, asking ``produce(name)`` for one tensor at a time.

    ``specs`` gives each tensor's name, shape and dtype up front (the header);
    tensors are written in order of decreasing element size, so that every
    tensor starts aligned to its element size, and each is dropped once
    written.
    """
    _check_little_endian()
    ordered = sorted(specs, key=lambda spec: -spec[2].itemsize)  # stable: keeps name order
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, shape, dtype in ordered:
        code = SAFETENSORS_DTYPES.get(dtype)
        if code is None:
            raise CheckpointError(
                f"{name!r} has dtype {dtype}, which safetensors cannot store; write it with "
                "fmt='torch'"
            )
        nbytes = _numel(shape) * dtype.itemsize
        header[name] = {
            "dtype": code,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        for name, shape, dtype in ordered:
            tensor = produce(name)
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise CheckpointError(
                    f"{name!r}: expected a {dtype} tensor of shape {tuple(shape)}, got "
                    f"{tensor.dtype} of shape {tuple(tensor.shape)}"
                )
            _write_tensor(file, tensor)
            del tensor


def read_safetensors(
    path: str | os.PathLike[str],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a safetensors file (CPU, own storage) and its ``__metadata__``."""
    _check_little_endian()
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
        start = 8 + length
        metadata = header.pop("__metadata__", None) or {}
        tensors: dict[str, torch.Tensor] = {}
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            dtype = _TORCH_DTYPES[entry["dtype"]]
            file.seek(start + begin)
            data = bytearray(file.read(end - begin))
            if len(data) != end - begin:
                raise CheckpointError(f"{path}: the data of {name!r} is cut short")
            flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
            tensors[name] = flat.reshape(entry["shape"])
    return tensors, dict(metadata)


def _write_tensor(file: BinaryIO, tensor: torch.Tensor) -> None:
    tensor = tensor.detach().cpu().contiguous()
    file.write(as_bytes(tensor))


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel


def _check_little_endian() -> None:
    if sys.byteorder != "little":
        raise CheckpointError("safetensors files are little-endian; this machine is big-endian")
