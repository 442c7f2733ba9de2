"""The debug-mode check that every rank runs the units' forward all-gathers in the same order.

Units all-gather their parameters in forward order, and a collective pairs
with whatever collective the peers issue next. If one rank runs the units in
another order (a data-dependent branch that skips or swaps a module), the
all-gathers of different units pair up: training hangs, fails far from the
cause, or silently mixes parameters of different units when the sizes agree.
With ``SHARD_DEBUG=detail``, or PyTorch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
(which turns on the same check in PyTorch's ``FullyShardedDataParallel``), the
root's :class:`ForwardOrderChecker` turns that into an error on every rank
naming the position and the unit each rank runs; its messages begin with
PyTorch's words.

[Note: Checking before the mismatched all-gather]
Comparing whole sequences at the end of the iteration would be too late: the
mismatched all-gather has already been issued and may never complete. So in
the first checked iteration each ``record(label)``, made right before the
unit's all-gather, first all-gathers a digest of the label through the same
group. The digest all-gathers pair up position by position, because every
earlier position matched and so did the real all-gathers between them. When
the digests differ, every rank sees the same gathered digests, so every rank
then gathers the labels (``all_gather_object``, on this error path only) and
raises the same ``RuntimeError``: nobody is left waiting in a collective.
``end_iteration`` takes part in the same exchange as an "end" entry, so a rank
that runs fewer units than the others is named at the first missing unit.

Cost: in the first checked iteration, one all-gather of two int64 per unit plus
one at the end of the iteration, each read back on the host (a device sync on
an accelerator); none on a single rank. Later iterations only compare each
label against the first iteration's sequence, locally, and warn once when the
order changes: the peers are not consulted, so a change that every rank makes
alike is harmless, and one that differs across ranks can only be diagnosed by
its warning. Nothing at all runs when the check is disabled.

The switches are read at the start of each iteration; like every setting that
decides which collectives run, they must be the same on every rank.
"""

from __future__ import annotations

import hashlib
import os
import warnings

import torch
import torch.distributed as dist

__all__ = ["ForwardOrderChecker", "order_check_enabled"]

_ENV = "SHARD_DEBUG"
_DETAIL = "detail"

# The first of the two int64 each rank contributes per position.
_KIND_END = 0  # the rank's iteration ended here
_KIND_UNIT = 1  # the rank is about to all-gather a unit; the second int64 is its digest


def order_check_enabled() -> bool:
    """Whether the forward-order check is asked for.

    ``SHARD_DEBUG=detail`` (any case), or PyTorch's debug level ``DETAIL``
    (``TORCH_DISTRIBUTED_DEBUG=DETAIL`` or ``dist.set_debug_level``).
    """
    if os.environ.get(_ENV, "").strip().lower() == _DETAIL:
        return True
    if not dist.is_available():
        return False
    from torch.distributed.distributed_c10d import DebugLevel, get_debug_level

    return bool(get_debug_level() == DebugLevel.DETAIL)


def _digest(label: str) -> int:
    """A digest of ``label``, the same in every process (``hash()`` is salted per process)."""
    data = hashlib.blake2b(label.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(data, "little", signed=True)


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the digests live for ``group``'s backend: the CPU for gloo, else the accelerator."""
    backend = str(dist.get_backend(group))
    if backend in ("gloo", "mpi") or "cpu:" in backend:
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def _describe(label: str | None) -> str:
    return "no unit (its iteration ended)" if label is None else repr(label)


class ForwardOrderChecker:
    """Checks that every rank of the root's group runs the units' all-gathers in one order.

    Each unit calls :meth:`record` right before its forward all-gather; the
    root calls :meth:`end_iteration` at the end of backward (or of forward when
    no backward runs). The first iteration run with :func:`order_check_enabled`
    is checked across ranks; later ones against that first one, locally. See
    [Note: Checking before the mismatched all-gather] for how and what it costs.

    Args:
        group: The root's data-parallel process group; ``None`` for the default group.
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self._group = group
        # - this iteration
        self._active: bool | None = None  # None until the iteration's first call reads the env var
        self._position = 0  # how many units this iteration recorded so far
        # - the first checked iteration
        self._first: list[str] = []  # its labels; complete once ``_reference_done``
        self._reference_done = False
        self._warned = False
        # - communication, resolved on first use
        self._world_size: int | None = None
        self._device: torch.device | None = None

    def record(self, label: str) -> None:
        """Note that unit ``label`` is about to all-gather; in the first iteration, check the peers.

        Raises:
            RuntimeError: another rank is at a different unit at this position
                (first iteration only; raised on every rank alike).
        """
        if not self._iteration_active():
            return
        position = self._position
        self._position += 1
        if not self._reference_done:
            self._exchange(position, label)
            self._first.append(label)
            return
        if self._warned:
            return
        expected = self._first[position] if position < len(self._first) else None
        if expected != label:
            self._warn(position, label, expected)

    def end_iteration(self) -> None:
        """Close the iteration; the first one is checked with the peers for a missing unit.

        Raises:
            RuntimeError: another rank ran more units in the first iteration
                (raised on every rank alike).
        """
        active, position = self._iteration_active(), self._position
        self._active, self._position = None, 0
        if not active:
            return
        if not self._reference_done:
            self._exchange(position, None)
            self._reference_done = True
        elif not self._warned and position < len(self._first):
            self._warn(position, None, self._first[position])

    def abandon_iteration(self) -> None:
        """Forget an iteration that raised half-way (``reset_iter_state``), without collectives.

        Every rank abandons the same iteration, so positions stay aligned; a
        first iteration that did not finish is checked again in the next one.
        """
        self._active, self._position = None, 0
        if not self._reference_done:
            self._first.clear()

    def _iteration_active(self) -> bool:
        if self._active is None:
            self._active = order_check_enabled()
        return self._active

    def _exchange(self, position: int, label: str | None) -> None:
        """Compare this rank's entry at ``position`` with every peer's; all raise if any differ."""
        # See [Note: Checking before the mismatched all-gather]
        if self._world_size is None:
            self._world_size = dist.get_world_size(self._group)
            self._device = _collective_device(self._group)
        if self._world_size == 1:
            return
        if label is None:
            mine = torch.tensor([_KIND_END, 0], dtype=torch.int64, device=self._device)
        else:
            mine = torch.tensor(
                [_KIND_UNIT, _digest(label)], dtype=torch.int64, device=self._device
            )
        gathered = [torch.empty_like(mine) for _ in range(self._world_size)]
        dist.all_gather(gathered, mine, group=self._group)
        entries = [tuple(t.tolist()) for t in gathered]
        if all(entry == entries[0] for entry in entries):
            return
        labels: list[str | None] = [None] * self._world_size
        dist.all_gather_object(labels, label, group=self._group)
        ranks = dist.get_process_group_ranks(self._group)
        runs = ", ".join(
            f"rank {rank} runs {_describe(other)}"
            for rank, other in zip(ranks, labels, strict=True)
        )
        raise RuntimeError(
            f"Forward order differs across ranks at unit position {position} of the first "
            f"iteration (after {position} unit(s) in the same order): {runs}. Every rank must "
            f"run the same units in the same order, or their all-gathers pair up wrongly and "
            f"training hangs or mixes parameters; look for a data-dependent branch that skips "
            f"or reorders a module on some ranks."
        )

    def _warn(self, position: int, label: str | None, expected: str | None) -> None:
        self._warned = True
        rank = dist.get_rank() if dist.is_initialized() else 0
        warnings.warn(
            f"Forward order differs from that of the first iteration on rank {rank}. "
            f"Collectives are unchecked and may give incorrect results or hang: at unit "
            f"position {position} this iteration runs {_describe(label)} where the first ran "
            f"{_describe(expected)}. Only the first iteration is checked across ranks "
            f"(SHARD_DEBUG=detail or TORCH_DISTRIBUTED_DEBUG=DETAIL); if the other ranks did "
            f"not change alike, all-gathers pair up wrongly. This warning is shown once.",
            stacklevel=3,
        )
