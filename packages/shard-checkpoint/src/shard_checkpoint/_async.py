"""Saving a checkpoint while training goes on: copy to CPU memory, write on a background thread.

[Note: asynchronous saves]
``async_save(state_dict, checkpoint_id=...)`` does on the calling thread
only what must see the values as they are at the call: it copies every
tensor into CPU memory kept from one save to the next (pinned, and copied
without blocking, when an accelerator is present), local tensors only
(``_staging.py``; DCP's ``DefaultStager`` for state dicts with other
leaves), then returns. A background thread runs ``save`` on that copy, the
same atomic, checksummed save a blocking call makes ([Note: atomic
checkpoints] in ``_storage.py``), and :class:`AsyncSave` ``.result()``
waits for it and raises its error.

- The writer thread runs under Linux's ``SCHED_IDLE``: it gets a core only
  when the training threads leave one idle (waiting in a collective, say),
  so on a machine whose cores training fills, a save takes longer instead of
  slowing the steps. Once something waits for the save (``result()``, the
  next save, ``close_async_saves``), the writer gets the normal priority
  back where Linux allows it (leaving ``SCHED_IDLE`` takes CAP_SYS_NICE or
  an ``RLIMIT_NICE`` that allows nice 0; many systems' default of 0 does
  not): elsewhere it keeps idle priority and runs on the core the waiting
  thread leaves idle, starved only by other processes that fill every
  core. While it runs, the interpreter's switch interval is 0.2 ms instead
  of 5 ms (restored after), so a training thread waiting for the GIL the
  writer holds gets it back sooner. On ``shard train``'s demo model (2 gloo ranks on 2 cores,
  ``tools/bench/bench_checkpoint.py --parts async``) this took the steps
  while a save is in flight from 1.6x the step without a save to
  1.06-1.09x.
- At most one save is in flight in a process: ``async_save`` and ``save``
  first wait for the one in flight (``_pending.py``), and raise its error
  instead of starting another. This also keeps the copy a running save
  reads intact: the next copy reuses its memory.
- The background save's collectives (DCP's exchange of plans, the rename's
  broadcast) run on a process group of their own, a gloo group over the
  same ranks created (collectively) at the first ``async_save`` without a
  ``process_group``: on the training's group the two threads' collectives
  would interleave in a different order on each rank.
- A process that dies during the write leaves ``<id>.incomplete-*`` and the
  previous checkpoint as it was; the new one appears only once complete.
- The CPU copy, the writer thread and the group stay for the next save;
  ``close_async_saves()`` (collective, after the last save: ``shard train``
  calls it when training ends) waits for the save in flight and frees all
  three.
- In one process without ``torch.distributed`` the background thread
  silences DCP's "single process" warning with ``warnings.catch_warnings``,
  which is not thread-safe: a ``catch_warnings`` of the main thread that
  overlaps it may keep (or lose) that one ignore filter afterwards, nothing
  else.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from shard_checkpoint import _pending
from shard_checkpoint._staging import StagingBuffers
from shard_checkpoint._storage import save_now

__all__ = ["AsyncSave", "async_save", "close_async_saves"]


class AsyncSave:
    """A checkpoint being written in the background; see :func:`async_save`.

    Attributes:
        checkpoint_id: Where it is being saved.
        blocked_s: Seconds the call to ``async_save`` took (waiting for the
            previous save, then copying the state to CPU memory): the time
            training stood still.
    """

    def __init__(
        self,
        checkpoint_id: Path,
        future: concurrent.futures.Future[Metadata],
        blocked_s: float,
        hurry: Callable[[], None],
    ) -> None:
        self.checkpoint_id = checkpoint_id
        self.blocked_s = blocked_s
        self._future = future
        self._hurry = hurry

    def done(self) -> bool:
        """Whether the save has finished (written and in place, or failed)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> Metadata:
        """Wait for the save; its DCP metadata.

        Raises:
            CheckpointError: the save failed (on some rank); the previous
                checkpoint at ``checkpoint_id`` is untouched.
            TimeoutError: not finished within ``timeout`` seconds.
        """
        if not self._future.done():
            self._hurry()
        try:
            return self._future.result(timeout)
        finally:
            if self._future.done():
                _pending.forget(self._future)


# How long the writer may hold the GIL while the training thread waits for it (Python's
# default is 5 ms); see [Note: asynchronous saves].
_SWITCH_INTERVAL_S = 0.0002

# One thread writes, one save at a time (see [Note: asynchronous saves]); made at the first
# async_save after a close.
_writer: concurrent.futures.ThreadPoolExecutor | None = None
_stager_lock = threading.Lock()
_buffers: StagingBuffers | None = None
_stager: DefaultStager | None = None
# The writer's thread id, once it has run a save, and the lock under which a save's writer and
# whoever waits for it set its scheduling policy (see [Note: asynchronous saves]).
_writer_thread: int | None = None
_priority_lock = threading.Lock()
# The default group the background group was made for, and that group.
_background: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None


def async_save(
    state_dict: Mapping[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str],
    process_group: dist.ProcessGroup | None = None,
    verify: bool = False,
    then: Callable[[Path], None] | None = None,
) -> AsyncSave:
    """Start saving ``state_dict`` at ``checkpoint_id``; return while it is written.

    Call it on every rank, as :func:`save`. The values saved are those at
    the call: the tensors are copied to CPU memory before it returns, so
    training may change them at once. See [Note: asynchronous saves].

    Args:
        state_dict: as for ``save`` (e.g. ``{"model": get_model_state_dict(model), ...}``).
        checkpoint_id: the checkpoint's directory; a checkpoint there is
            replaced only once the new one is complete.
        process_group: the ranks that save together. Its collectives run on
            the background thread while training runs, so it must be a group
            nothing else uses meanwhile; ``None``: a gloo group over the
            default group's ranks, made for this (collectively, once).
        verify: as for ``save``: each rank reads its files back against their
            checksums before the checkpoint is put in place.
        then: called on the background thread with the checkpoint's path once
            it is in place, on every rank (e.g. to remove older checkpoints);
            what it raises, ``result()`` raises.

    Returns:
        The save in flight; ``result()`` waits for it.

    Raises:
        CheckpointError: the previous save (in flight until now) failed.
    """
    started = time.perf_counter()
    _pending.wait()
    path = Path(checkpoint_id)
    group = _background_group(process_group)
    staged = _stage(dict(state_dict))

    hurried = threading.Event()

    def hurry() -> None:
        with _priority_lock:
            hurried.set()
            if _writer_thread is not None:
                _set_policy(_writer_thread, "SCHED_OTHER")

    def write() -> Metadata:
        global _writer_thread
        with _priority_lock:  # waited for before it started: normal priority from the start
            _writer_thread = threading.get_native_id()
            _set_policy(_writer_thread, "SCHED_OTHER" if hurried.is_set() else "SCHED_IDLE")
        with _yielding_gil():
            metadata = save_now(staged, checkpoint_id=path, process_group=group, verify=verify)
            if then is not None:
                then(path)
        return metadata

    global _writer
    if _writer is None:
        _writer = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="shard-ckpt"
        )
    future = _writer.submit(write)
    _pending.track(future, hurry)
    return AsyncSave(path, future, time.perf_counter() - started, hurry)


def close_async_saves() -> None:
    """Wait for the save in flight, then free the CPU copy, the writer thread and the group.

    Call it on every rank after the last ``async_save`` (a later one starts
    afresh). See [Note: asynchronous saves].

    Raises:
        CheckpointError: the save in flight failed (the memory is freed all the same).
    """
    global _buffers, _stager, _background, _writer, _writer_thread
    try:
        _pending.wait()
    finally:
        if _writer is not None:
            _writer.shutdown(wait=True)
            _writer, _writer_thread = None, None
        with _stager_lock:
            _buffers = None
            if _stager is not None:
                _stager.close()
                _stager = None
        if _background is not None:
            group = _background[1]
            _background = None
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group(group)


def _stage(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state_dict`` in CPU memory, reusing the previous copy's (see the Note)."""
    global _buffers, _stager
    accelerated = torch.accelerator.is_available()
    with _stager_lock:
        if _buffers is None:
            _buffers = StagingBuffers(pin_memory=accelerated)
        staged = _buffers.stage(state_dict)
        if staged is not None:
            return staged
        if _stager is None:
            _stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=accelerated,
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=accelerated,
                )
            )
        fallback = _stager.stage(state_dict)
    assert isinstance(fallback, dict)
    return fallback


def _set_policy(thread: int, name: str) -> None:
    """Put ``thread`` under Linux's scheduling policy ``name``, where the platform has it."""
    policy = getattr(os, name, None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return
    # Refused (see the Note: an unprivileged thread may not leave SCHED_IDLE under RLIMIT_NICE 0)
    # or the thread is gone: the priority stays as it was, which only changes how long a save
    # takes.
    with contextlib.suppress(OSError):
        os.sched_setscheduler(thread, policy, os.sched_param(0))


@contextlib.contextmanager
def _yielding_gil() -> Iterator[None]:
    """While the writer runs, make the interpreter hand the GIL to a waiting thread sooner."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, _SWITCH_INTERVAL_S))
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _background_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group the background save's collectives use; see [Note: asynchronous saves]."""
    global _background
    if process_group is not None or not (dist.is_available() and dist.is_initialized()):
        return process_group
    world = dist.group.WORLD
    assert world is not None
    if _background is None or _background[0] is not world:
        group = dist.new_group(backend="gloo")
        assert group is not None
        _background = (world, group)
    return _background[1]
