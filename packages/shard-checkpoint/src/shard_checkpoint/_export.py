"""One file of a live sharded model's full state dict, written by rank 0 as it is gathered.

Saving a sharded checkpoint and consolidating it later costs a second copy
of the model on disk and a second pass; gathering a full state dict on rank
0 and saving it costs the whole model in rank 0's memory. Exporting streams
instead: the file's header is written from shapes and dtypes alone, then the
values are gathered one after another and each is written and dropped
before the next is gathered.

[Note: streaming export]
Every rank plans the same list of values from the model alone, without
communication: each ``FullyShardedDataParallel`` unit's original parameters
(shapes from :func:`shard_runtime.flat_units`, the unit's full-precision
dtype), then every other state-dict value (``fully_shard`` parameters as
DTensors, whose ``.shape`` is the full one; buffers, in their dtype before
any mixed-precision cast; unsharded parameters), in ``get_model_state_dict``'s
order.
Then every rank walks the values in the order the file's writer asks for
them (safetensors: decreasing element size, keeping state-dict order among
equals; torch: state-dict order), so the collectives match across ranks:

- a unit parameter: the unit is summoned (``summon_full_params`` with
  ``recurse=False, rank0_only=True, offload_to_cpu=True``) unless it already
  is, after leaving the previously summoned unit; consecutive parameters of
  one unit share one gather, and a unit met again later is gathered again;
- a DTensor: ``full_tensor()``, one parameter;
- anything else: read as it is, no communication.

Rank 0 writes each value and drops it; the other ranks drop theirs. A rank
therefore holds, beyond the model, one unit's full flat buffer or one full
parameter at a time.

[Note: atomic export]
Rank 0 checks ``out_path`` first and broadcasts the verdict, so a bad path
fails on every rank before anything is gathered. It writes to
``<out_path>.incomplete-<token>`` beside the target, fsyncs it and renames it
onto ``out_path`` (atomic on POSIX), so an existing file there is replaced
only by a complete one. If rank 0's writing fails (a full disk, say), it
keeps taking part in the remaining gathers without writing, removes the
partial file and broadcasts the error, so every rank raises the same
``CheckpointError`` and the ranks stay in step. A process killed mid-export
leaves the old file and a visibly incomplete ``.incomplete-`` file.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shard_checkpoint._dist import broadcast_object, rank
from shard_checkpoint._errors import CheckpointError
from shard_checkpoint._model import in_module_order, plain_entries, reshard_model
from shard_checkpoint._safetensors import SAFETENSORS_DTYPES, write_safetensors
from shard_checkpoint._storage import INCOMPLETE_MARK, _fsync_directory
from shard_checkpoint._tensors import full_value
from shard_checkpoint._torch_file import TensorPlaceholder, write_torch_file
from shard_runtime import FullyShardedDataParallel
from shard_runtime.plumbing import FlatUnit, clean_fqn, flat_units, original_buffer_dtypes

__all__ = ["ExportFormat", "ExportReport", "export_full_state_dict"]

ExportFormat = Literal["safetensors", "torch"]


@dataclass(frozen=True, slots=True)
class ExportReport:
    """What :func:`export_full_state_dict` wrote (returned on rank 0 only).

    Attributes:
        path: the file written (``out_path``).
        fmt: ``"safetensors"`` or ``"torch"``.
        num_tensors: tensors written, one per state-dict key (tied weights
            once per key).
        num_bytes: bytes of tensor data written; the file adds its header
            (safetensors) or zip records (torch) to these.
        largest_gather_bytes: the most gathered bytes held at once: the
            largest unit's full flat buffer (padding included) for
            ``FullyShardedDataParallel``, the largest full parameter for
            ``fully_shard``; 0 when nothing is sharded.
    """

    path: Path
    fmt: ExportFormat
    num_tensors: int
    num_bytes: int
    largest_gather_bytes: int


@dataclass(frozen=True, slots=True)
class _Entry:
    """One state-dict value to export, known without gathering it."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None  # None: not a tensor (extra state); ``value`` is the object
    unit: int | None  # index into the units for a wrapper unit's parameter, else None
    owner: nn.Module | None  # the module registering the unit parameter, and its attribute
    attr: str
    value: Any  # the state-dict value when not a unit parameter: DTensor, tensor or object

    @property
    def nbytes(self) -> int:
        assert self.dtype is not None
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


def export_full_state_dict(
    model: nn.Module,
    out_path: str | os.PathLike[str],
    *,
    fmt: ExportFormat = "safetensors",
    metadata: Mapping[str, str] | None = None,
) -> ExportReport | None:
    """Write ``model``'s full state dict to one file on rank 0, one unit at a time.

    A collective: call it on every rank of the model's process group, with
    the model between steps. Keys and values are those of the plain
    (unwrapped) model's ``state_dict()``, as ``get_model_state_dict`` gives
    them: parameters in their full precision whatever the mixed-precision
    policy, buffers in their own dtype (also those a wrapper's
    ``MixedPrecision.buffer_dtype`` cast).
    Beyond the model, a rank holds one unit's full parameters at a time
    (``FullyShardedDataParallel``) or one full parameter (``fully_shard``).
    See [Note: streaming export] and [Note: atomic export].

    Args:
        model: a model sharded by ``fully_shard``, a ``FullyShardedDataParallel``
            model, or a plain model (one process is enough).
        out_path: the file rank 0 writes; its directory must exist. An existing
            file there is replaced once the new one is complete.
        fmt: ``"safetensors"`` (tensors only; in the file, tensors of larger
            elements come first, state-dict order otherwise) or ``"torch"`` (a
            ``torch.save`` file of the state dict, in its order, extra state
            included).
        metadata: safetensors only: strings stored in the header's
            ``__metadata__``, after ``{"format": "pt"}`` (which they may
            override).

    Returns:
        On rank 0, what was written; ``None`` on every other rank.

    Raises:
        ValueError: an unknown ``fmt``, or ``metadata`` with ``fmt="torch"``.
        TypeError: a ``metadata`` key or value that is not a string.
        CheckpointError: on every rank: ``out_path`` cannot be written (a
            directory, no parent directory, a full disk), or, with safetensors,
            a value is not a tensor or has a dtype safetensors cannot store.
    """
    _check_arguments(fmt, metadata)
    units = flat_units(model)
    entries = _plan(model, units)
    if fmt == "safetensors":
        _check_safetensors(entries)
        # The writer's own order (see write_safetensors); every rank follows it.
        order = sorted(entries, key=lambda e: -e.dtype.itemsize if e.dtype else 0)
    else:
        order = entries
    tensors = [e for e in order if e.dtype is not None]
    out = Path(out_path)
    staging = broadcast_object(_prepare(out) if rank() == 0 else None)
    if isinstance(staging, CheckpointError):
        raise staging
    source = _Source(units)
    if rank() != 0:
        try:
            for entry in tensors:
                source.produce(entry)
        finally:
            source.close()
        outcome = broadcast_object(None)
        if outcome is not None:
            raise CheckpointError(outcome)
        return None
    assert isinstance(staging, str)
    error = _write_on_rank0(out, Path(staging), fmt, metadata, order, tensors, source)
    broadcast_object(None if error is None else str(error))
    if error is not None:
        raise error
    return ExportReport(
        path=out,
        fmt=fmt,
        num_tensors=len(tensors),
        num_bytes=sum(e.nbytes for e in tensors),
        largest_gather_bytes=_largest_gather(units, entries),
    )


# ------------------------------------------------------------------ planning


def _check_arguments(fmt: str, metadata: Mapping[str, str] | None) -> None:
    if fmt not in ("safetensors", "torch"):
        raise ValueError(
            f"export_full_state_dict: fmt must be 'safetensors' or 'torch', got {fmt!r}"
        )
    if metadata is None:
        return
    if fmt == "torch":
        raise ValueError(
            "export_full_state_dict: metadata is stored in safetensors headers only; pass "
            "fmt='safetensors' or leave metadata out"
        )
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"export_full_state_dict: metadata maps strings to strings, got {key!r}: "
                f"{value!r}; convert the value with str() or json.dumps()"
            )


def _plan(model: nn.Module, units: list[FlatUnit]) -> list[_Entry]:
    """Every value of the plain model's state dict, in its order, from shapes alone.

    Keys and order are those of ``get_model_state_dict``; buffers that a
    wrapper's mixed precision cast are planned in their original dtype.
    """
    reshard_model(model)
    modules = {clean_fqn(name): m for name, m in model.named_modules(remove_duplicate=False)}
    entries: dict[str, _Entry] = {}
    for index, unit in enumerate(units):
        dtype = unit.shard.dtype  # the unit's full precision, which summon_full_params shows
        for param in unit.params:
            for key in param.keys:
                prefix, _, attr = key.rpartition(".")
                entries[key] = _Entry(
                    key, tuple(param.shape), dtype, index, modules[prefix], attr, None
                )
    params = {*entries, *(name for name, _ in model.named_parameters(remove_duplicate=False))}
    dtypes = original_buffer_dtypes(model)
    for key, value in plain_entries(model, units, keep_vars=False).items():
        if isinstance(value, torch.Tensor):
            dtype = dtypes.get(key, value.dtype)
            entries[key] = _Entry(key, tuple(value.shape), dtype, None, None, "", value)
        else:
            entries[key] = _Entry(key, (), None, None, None, "", value)
    return list(in_module_order(model, entries, params).values())


def _check_safetensors(entries: list[_Entry]) -> None:
    for entry in entries:
        if entry.dtype is None:
            raise CheckpointError(
                f"export_full_state_dict: {entry.key!r} is a {type(entry.value).__name__}, not "
                "a tensor, and safetensors holds tensors only; pass fmt='torch'"
            )
        if entry.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(
                f"export_full_state_dict: {entry.key!r} has dtype {entry.dtype}, which "
                "safetensors cannot store; pass fmt='torch'"
            )


def _largest_gather(units: list[FlatUnit], entries: list[_Entry]) -> int:
    flat = [u.world * u.shard_numel * u.shard.element_size() for u in units]
    dtensors = [e.nbytes for e in entries if isinstance(e.value, DTensor)]
    return max(flat + dtensors, default=0)


# ------------------------------------------------------------------ gathering


class _Source:
    """Full values in the planned order, on every rank; at most one unit summoned at a time.

    ``produce`` is a collective for unit parameters and DTensors; it returns
    the full value on rank 0 and ``None`` elsewhere.
    """

    def __init__(self, units: list[FlatUnit]) -> None:
        self._units = units
        self._summoned: int | None = None
        self._stack = contextlib.ExitStack()
        self.produced = 0
        """How many entries have been produced (rank 0 drains the rest after a failure)."""
        self.broken = False
        """A gather failed: the ranks are out of step and nothing more may be gathered."""

    def produce(self, entry: _Entry) -> torch.Tensor | None:
        try:
            value = self._full(entry)
        except BaseException:
            self.broken = True
            raise
        self.produced += 1
        return value

    def close(self) -> None:
        self._stack.close()
        self._summoned = None

    def _full(self, entry: _Entry) -> torch.Tensor | None:
        if entry.unit is not None:
            self._summon(entry.unit)
            if rank() != 0:
                return None
            assert entry.owner is not None
            full: torch.Tensor = getattr(entry.owner, entry.attr)
            return full.detach()
        value = entry.value
        assert isinstance(value, torch.Tensor)
        if isinstance(value, DTensor):
            gathered = full_value(value)
            return gathered.detach() if rank() == 0 else None
        if rank() != 0:
            return None
        return value.detach().to(entry.dtype)  # See original_buffer_dtypes

    def _summon(self, index: int) -> None:
        if self._summoned == index:
            return
        self.close()
        self._stack.enter_context(
            FullyShardedDataParallel.summon_full_params(
                self._units[index].wrapper,
                recurse=False,
                writeback=False,
                rank0_only=True,
                offload_to_cpu=True,
            )
        )
        self._summoned = index


# ------------------------------------------------------------------ writing


def _prepare(out: Path) -> str | CheckpointError:
    """Rank 0: check ``out`` can take the file; name the staging file beside it."""
    if out.is_dir():
        return CheckpointError(
            f"export_full_state_dict: cannot write {out}: it is a directory; pass a file path"
        )
    if not out.parent.is_dir():
        return CheckpointError(
            f"export_full_state_dict: cannot write {out}: the directory {out.parent} does not "
            "exist; create it first"
        )
    return str(out.with_name(f"{out.name}{INCOMPLETE_MARK}{uuid.uuid4().hex[:12]}"))


def _write_on_rank0(
    out: Path,
    staging: Path,
    fmt: ExportFormat,
    metadata: Mapping[str, str] | None,
    order: list[_Entry],
    tensors: list[_Entry],
    source: _Source,
) -> CheckpointError | None:
    """Write the file and move it into place; the error to raise on every rank, if any.

    See [Note: atomic export].
    """
    by_key = {e.key: e for e in tensors}

    def produce(key: str) -> torch.Tensor:
        value = source.produce(by_key[key])
        assert value is not None
        return value

    try:
        try:
            _write(staging, fmt, metadata, order, produce)
            with open(staging, "rb+") as file:
                os.fsync(file.fileno())
            os.replace(staging, out)
            _fsync_directory(out.parent)
        except Exception as exc:
            if source.broken:
                raise
            for entry in tensors[source.produced :]:
                source.produce(entry)  # keep the other ranks' gathers in step
            with contextlib.suppress(OSError):
                staging.unlink()
            error = CheckpointError(
                f"export_full_state_dict: writing {out} failed: {type(exc).__name__}: {exc}; "
                f"the file there (if any) is untouched"
            )
            error.__cause__ = exc
            return error
    finally:
        source.close()
    return None


def _write(
    path: Path,
    fmt: ExportFormat,
    metadata: Mapping[str, str] | None,
    order: list[_Entry],
    produce: Callable[[str], torch.Tensor],
) -> None:
    if fmt == "safetensors":
        specs = [(e.key, e.shape, e.dtype) for e in order if e.dtype is not None]
        write_safetensors(path, specs, produce, metadata={"format": "pt", **(metadata or {})})
    else:
        layout = {
            e.key: TensorPlaceholder(e.shape, e.dtype) if e.dtype is not None else e.value
            for e in order
        }
        write_torch_file(path, layout, produce)
