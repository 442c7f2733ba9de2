"""``shard ckpt inspect`` and ``shard ckpt consolidate``: a checkpoint without a training job.

Both read only ``torch.distributed.checkpoint`` metadata and files (one
process, no process group): ``inspect`` prints :func:`inspect_checkpoint`
(``_ckpt_inspect.py``): every key with its full shape, dtype and size, the
number of ranks that wrote the checkpoint and the total size, and with
``--verify`` reads every file back against the checksums its save wrote
(exit status 1 and the culprit named when one differs: file, rank, key, and
the newest intact checkpoint beside it); ``consolidate`` is
shard-checkpoint's streaming export to one safetensors or ``torch.save``
file.

The parser is part of the one ``shard --help`` builds, so shard-checkpoint
and torch are imported by the commands when they run, not by this module
(see [Note: a torch-free parser] in ``__main__.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from shard_cli._format import format_bytes

if TYPE_CHECKING:
    from shard_checkpoint import VerifyReport

__all__ = ["add_ckpt_parser"]


def _inspect(args: argparse.Namespace) -> int:
    from shard_checkpoint import CheckpointError, CorruptCheckpointError, verify_checkpoint
    from shard_cli._ckpt_inspect import inspect_checkpoint

    try:
        info = inspect_checkpoint(args.dir)
        verified = verify_checkpoint(info.path) if args.verify else None
    except CorruptCheckpointError as exc:
        print(f"shard ckpt inspect: {exc}", file=sys.stderr)
        return 1
    except CheckpointError as exc:
        print(f"shard ckpt inspect: {exc}", file=sys.stderr)
        return 2
    if args.json:
        data: dict[str, Any] = {
            "path": str(info.path),
            "world_size": info.world_size,
            "tensor_bytes": info.tensor_bytes,
            "file_bytes": info.file_bytes,
            "entries": [
                {
                    "key": e.key,
                    "shape": list(e.shape) if e.shape is not None else None,
                    "dtype": e.dtype,
                    "bytes": e.nbytes,
                    "chunks": e.chunks,
                }
                for e in info.entries
            ],
        }
        if info.steps:
            data["steps"] = list(info.steps)
        if verified is not None:
            data["verified"] = {
                "checksummed": verified.checksummed,
                "files": verified.files,
                "bytes": verified.bytes,
            }
        print(json.dumps(data, indent=2))
        return 0
    width = max((len(e.key) for e in info.entries), default=3)
    if info.steps:
        steps = ", ".join(str(step) for step in info.steps)
        print(f"{args.dir}: step checkpoints {steps}; the newest:")
    print(
        f"{info.path}: {len(info.entries)} keys, written by {info.world_size} rank"
        f"{'s' if info.world_size != 1 else ''}, tensors {format_bytes(info.tensor_bytes)} "
        f"({info.tensor_bytes} bytes), files {format_bytes(info.file_bytes)}"
    )
    print(f"  {'key':<{width}}  {'shape':<16} {'dtype':<9} {'bytes':>10}  chunks")
    for e in info.entries:
        shape = "x".join(str(d) for d in e.shape) if e.shape is not None else "-"
        if e.shape == ():
            shape = "scalar"
        print(f"  {e.key:<{width}}  {shape:<16} {e.dtype:<9} {e.nbytes:>10}  {e.chunks}")
    if verified is not None:
        print(_verified_line(verified))
    return 0


def _verified_line(report: VerifyReport) -> str:
    if not report.checksummed:
        return (
            f"not verified: {report.path} has no checksums (written by PyTorch's "
            "torch.distributed.checkpoint, or before shard-checkpoint wrote them)"
        )
    return (
        f"verified: every byte of its {report.files} files ({format_bytes(report.bytes)}) matches "
        "the checksums its save wrote"
    )


def _consolidate(args: argparse.Namespace) -> int:
    from shard_checkpoint import CheckpointError, consolidate
    from shard_cli._ckpt_inspect import inspect_checkpoint

    try:
        prefix = args.prefix
        if prefix is None:
            keys = [e.key for e in inspect_checkpoint(args.dir).entries]
            prefix = "model." if any(k.startswith("model.") for k in keys) else ""
        out = consolidate(args.dir, args.out, fmt=args.format, prefix=prefix)
    except CheckpointError as exc:
        print(f"shard ckpt consolidate: {exc}", file=sys.stderr)
        return 2
    what = f"keys under {prefix!r}" if prefix else "every key"
    print(f"wrote {out} ({args.format}, {what}, {format_bytes(out.stat().st_size)})")
    return 0


def add_ckpt_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``shard ckpt inspect`` and ``shard ckpt consolidate``."""
    p = sub.add_parser("ckpt", help="inspect or consolidate a checkpoint")
    ckpt = p.add_subparsers(dest="ckpt_command", required=True)
    inspect = ckpt.add_parser(
        "inspect", help="keys, shapes, dtypes, writing world size and total bytes"
    )
    inspect.add_argument(
        "dir", help="the checkpoint directory (or a directory of step-<N> checkpoints: the newest)"
    )
    inspect.add_argument("--json", action="store_true", help="print JSON")
    inspect.add_argument(
        "--verify",
        action="store_true",
        help="read every file and check it against its checksums (exit status 1 if one differs)",
    )
    inspect.set_defaults(run=_inspect)
    cons = ckpt.add_parser(
        "consolidate", help="write the full tensors to one file, one tensor at a time"
    )
    cons.add_argument("dir", help="the checkpoint directory")
    cons.add_argument("out", help="the file to write")
    cons.add_argument(
        "--format", choices=("safetensors", "torch"), default="safetensors", help="file format"
    )
    cons.add_argument(
        "--prefix",
        help="keep keys under this prefix, without it (default: 'model.' when the checkpoint "
        "has a model, as shard train writes; '' keeps every key)",
    )
    cons.set_defaults(run=_consolidate)
