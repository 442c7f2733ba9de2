"""What a checkpoint holds, read from its ``torch.distributed.checkpoint`` metadata.

One process, no process group: every key with its full shape, dtype and
size, the number of ranks that wrote the checkpoint and the total size.
``shard ckpt inspect`` prints it (``_ckpt_command.py``). A directory of
``step-<N>`` checkpoints (``shard train``'s) is described by its newest
step; ``steps`` lists them all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shard_checkpoint import resolve_checkpoint, step_checkpoints, step_of

__all__ = ["CheckpointEntry", "CheckpointInfo", "inspect_checkpoint"]

_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp$")


@dataclass(frozen=True)
class CheckpointEntry:
    """One key of a checkpoint.

    Attributes:
        key: The flat key (``"model.blocks.0.attn.qkv.weight"``).
        shape: The full (unsharded) shape; ``None`` for a non-tensor value.
        dtype: The dtype's name (``"float32"``); ``"object"`` for a non-tensor value.
        nbytes: The full tensor's size (0 for a non-tensor value).
        chunks: How many saved pieces make it up (one per shard written).
    """

    key: str
    shape: tuple[int, ...] | None
    dtype: str
    nbytes: int
    chunks: int


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``shard ckpt inspect`` reports.

    Attributes:
        path: The complete checkpoint directory read.
        entries: Every key, in the checkpoint's order.
        world_size: Ranks that wrote it (from the names of its data files).
        tensor_bytes: Sum of the full tensors' sizes.
        file_bytes: Sum of the sizes of the files in the directory.
        steps: The steps of the complete ``step-<N>`` checkpoints in the
            directory given, when it holds those (``path`` is the newest);
            empty for a checkpoint given itself.
    """

    path: Path
    entries: tuple[CheckpointEntry, ...]
    world_size: int
    tensor_bytes: int
    file_bytes: int
    steps: tuple[int, ...] = ()


def inspect_checkpoint(checkpoint_id: str | Path) -> CheckpointInfo:
    """Read the metadata of the checkpoint at ``checkpoint_id``.

    Raises:
        shard_checkpoint.CheckpointError: no complete checkpoint there.
    """
    path = resolve_checkpoint(checkpoint_id)
    steps: tuple[int, ...] = ()
    if path.parent == Path(checkpoint_id) and step_of(path) is not None:
        steps = tuple(
            step for p in step_checkpoints(checkpoint_id) if (step := step_of(p)) is not None
        )
    metadata = FileSystemReader(path).read_metadata()
    entries = []
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            dtype = entry.properties.dtype
            shape = tuple(entry.size)
            numel = 1
            for dim in shape:
                numel *= dim
            entries.append(
                CheckpointEntry(
                    key=key,
                    shape=shape,
                    dtype=str(dtype).removeprefix("torch."),
                    nbytes=numel * torch.empty((), dtype=dtype).element_size(),
                    chunks=len(entry.chunks),
                )
            )
        else:
            entries.append(CheckpointEntry(key=key, shape=None, dtype="object", nbytes=0, chunks=1))
    ranks: set[int] = set()
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    for info in storage.values():
        match = _RANK_FILE.search(str(getattr(info, "relative_path", "")))
        if match:
            ranks.add(int(match.group(1)))
    return CheckpointInfo(
        path=path,
        entries=tuple(entries),
        world_size=max(ranks) + 1 if ranks else 1,
        tensor_bytes=sum(e.nbytes for e in entries),
        file_bytes=sum(f.stat().st_size for f in path.iterdir() if f.is_file()),
        steps=steps,
    )
