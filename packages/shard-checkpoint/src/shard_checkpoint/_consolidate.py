"""One file from a sharded checkpoint, streamed tensor by tensor.

``consolidate`` reads the checkpoint's DCP metadata (every key's full shape
and dtype, and where each saved chunk lies), writes the output's header
from it, then loads one full tensor at a time through DCP's reader (which
reads just that tensor's chunks and copies them into place), writes it and
drops it. Peak memory is one full tensor plus one saved chunk being copied,
whatever the checkpoint's size.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from shard_checkpoint._errors import CheckpointError
from shard_checkpoint._integrity import VerifyingReader
from shard_checkpoint._safetensors import write_safetensors
from shard_checkpoint._storage import (
    first_corruption,
    newest_intact_beside,
    quiet_single_process,
    resolve_checkpoint,
)
from shard_checkpoint._torch_file import TensorPlaceholder, write_torch_file

__all__ = ["consolidate"]

ConsolidatedFormat = Literal["safetensors", "torch"]


class _CachedMetadataReader(VerifyingReader):
    """A reader that reads ``.metadata`` once for many loads, checking what it reads."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


def consolidate(
    checkpoint_id: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    fmt: ConsolidatedFormat = "safetensors",
    prefix: str = "",
) -> Path:
    """Write the checkpoint's full tensors to one file, holding one tensor at a time.

    Runs in one process (no process group needed); keys are the checkpoint's
    flat keys (``"model.blocks.0.inner.weight"`` for a state dict saved as
    ``{"model": ...}``).

    Args:
        checkpoint_id: a checkpoint written by :func:`save` (or any DCP
            file-system checkpoint).
        out_path: the file to write.
        fmt: ``"safetensors"`` (tensors only) or ``"torch"`` (a ``torch.save``
            file of a flat dict, non-tensor values included).
        prefix: keep only keys that start with it, and drop it from their
            names: ``prefix="model."`` writes the model's own state dict.

    Returns:
        ``out_path`` as a ``Path``. It appears only once complete (written
        beside it as ``.<name>.incomplete`` first): a failed consolidation
        leaves no partial file, and an earlier file there as it was.

    Raises:
        CorruptCheckpointError: a file of the checkpoint differs from what its
            save wrote (every byte read is checked against its checksum).
        CheckpointError: the checkpoint is missing or incomplete, no key
            starts with ``prefix``, or (safetensors) a kept value is not a
            tensor or has a dtype safetensors cannot store.
    """
    if fmt not in ("safetensors", "torch"):
        raise ValueError(f"consolidate: fmt must be 'safetensors' or 'torch', got {fmt!r}")
    path = resolve_checkpoint(checkpoint_id)
    reader = _CachedMetadataReader(path)
    metadata = reader.read_metadata()
    entries = {
        key[len(prefix) :]: (key, entry)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefix)
    }
    if not entries:
        raise CheckpointError(
            f"consolidate: no key of checkpoint {path} starts with {prefix!r}; its keys start "
            f"with {sorted({k.split('.')[0] for k in metadata.state_dict_metadata})}"
        )

    def produce(name: str) -> torch.Tensor:
        key, entry = entries[name]
        assert isinstance(entry, TensorStorageMetadata)
        tensor = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        _load_one(reader, key, tensor)
        return tensor

    out = Path(out_path)
    partial = out.with_name(f".{out.name}.incomplete")
    try:
        _write(fmt, partial, path, entries, reader, produce)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, out)
    return out


def _write(
    fmt: ConsolidatedFormat,
    out: Path,
    path: Path,
    entries: dict[str, tuple[str, Any]],
    reader: VerifyingReader,
    produce: Callable[[str], torch.Tensor],
) -> None:
    """Write the file ``out`` (``consolidate`` renames it into place once complete)."""
    if fmt == "safetensors":
        specs = []
        for name, (key, entry) in entries.items():
            if not isinstance(entry, TensorStorageMetadata):
                raise CheckpointError(
                    f"consolidate: {key!r} in checkpoint {path} is not a tensor, and "
                    "safetensors holds tensors only; pass a prefix that leaves it out (e.g. "
                    "prefix='model.') or fmt='torch'"
                )
            specs.append((name, tuple(entry.size), entry.properties.dtype))
        write_safetensors(out, specs, produce, metadata={"format": "pt"})
    else:
        layout: dict[str, Any] = {}
        for name, (key, entry) in entries.items():
            if isinstance(entry, TensorStorageMetadata):
                layout[name] = TensorPlaceholder(tuple(entry.size), entry.properties.dtype)
            else:
                assert isinstance(entry, BytesStorageMetadata)
                box: dict[str, Any] = {key: None}
                _load_one(reader, key, box)
                layout[name] = box[key]
        write_torch_file(out, layout, produce)


def _load_one(reader: VerifyingReader, key: str, target: torch.Tensor | dict[str, Any]) -> None:
    """Fill ``target`` from the checkpoint: a tensor, or a dict whose ``key`` gets an object."""
    state_dict = {key: target} if isinstance(target, torch.Tensor) else target
    try:
        with quiet_single_process():
            dcp_load(
                state_dict,
                storage_reader=reader,
                planner=DefaultLoadPlanner(),
                no_dist=True,
            )
    except CheckpointException as exc:
        corrupt = first_corruption(exc)
        if corrupt is None:
            raise
        raise corrupt.with_intact(newest_intact_beside(Path(reader.path))) from None
