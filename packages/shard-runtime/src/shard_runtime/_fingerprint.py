"""Every rank shards the same model: one small all-gather at the root's lazy init.

[Note: model fingerprints]
Sharding assumes every rank of the mesh holds the same model, cut into the
same units in the same order: each all-gather and reduce-scatter exchanges
one unit's shards by position. A model built differently on one rank (a
rank-dependent shape, a layer added under ``if rank == 0``, a wrap policy
that decides differently) otherwise surfaces far from its cause: a
collective that hangs until the timeout, or one that silently pairs the
shards of different parameters.

So the root's lazy init (both front ends: ``fully_shard`` and the wrapper
share it) describes the tree it is about to drive, in order: each unit's
label, then each of its parameters' name, global shape, dtype and
``requires_grad``. It hashes the description and all-gathers the digest (four
int64 per rank) over the shard axis, and over the replicate axis on a 2-D
mesh: one tiny collective per root, once, nothing per step. Only when the
digests differ do the ranks exchange the descriptions themselves (an
``all_gather_object``, on the error path only), find the first entry where
they part and raise :class:`~shard_core.errors.ModelMismatchError` naming it
and the ranks on each side. Every rank raises the same error, so the process
group stays usable (nothing is left half-way).

The wrapper's ``sync_module_states=True`` broadcasts the whole module at
construction, before any unit exists: it compares the module's parameters
and buffers the same way first (:func:`check_same_tensors`).

``SHARD_FINGERPRINT=0`` skips the check (a model that differs on purpose
across ranks of one mesh is unsupported; the switch exists to measure it).
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Sequence

import torch
import torch.distributed as dist

from shard_core.errors import ModelMismatchError
from shard_runtime._unit import Unit

__all__ = ["check_same_model", "check_same_tensors", "describe_units"]

_ENV = "SHARD_FINGERPRINT"
_DIGEST_WORDS = 3  # int64 words of the sha256 digest compared; a fourth holds the length


def describe_units(units: Sequence[Unit]) -> list[str]:
    """The fingerprint's entries: per unit its label, then each parameter it shards.

    An entry is a short human-readable line, so the error can quote the first
    one that differs as is.
    """
    entries: list[str] = []
    for index, unit in enumerate(units):
        # The root's parameters are named from the root (the wrapper labels its root
        # unit with the class name, which is no prefix of theirs).
        label = unit.label if index else ""
        entries.append(f"unit {label or '(root)'!r}")
        entries.extend(_param_entry(*facts) for facts in unit.layout.describe_params(label))
    return entries


def _param_entry(fqn: str, shape: tuple[int, ...], dtype: torch.dtype, grad: bool) -> str:
    dtype_name = str(dtype).removeprefix("torch.")
    return f"parameter {fqn!r} shape {shape} {dtype_name} requires_grad={grad}"


def check_same_model(units: Sequence[Unit], *, api: str) -> None:
    """Raise ``ModelMismatchError`` unless every rank of the root's mesh has the same units.

    ``units[0]`` is the root's; its mesh decides the ranks compared. Call it
    on every rank, at the same point (the root's lazy init). See
    [Note: model fingerprints].
    """
    if not units or os.environ.get(_ENV, "1") == "0":
        return
    root = units[0]
    groups = [root.shard_group]
    if root.replicate_group is not None:
        groups.append(root.replicate_group)
    if all(group.size() == 1 for group in groups):
        return
    _check_groups(describe_units(units), groups, root.compute_device, api)


def check_same_tensors(
    named: Sequence[tuple[str, torch.Tensor]], groups: Sequence[dist.ProcessGroup], api: str
) -> None:
    """Raise ``ModelMismatchError`` unless all ranks of ``groups`` hold the same ``named`` tensors.

    For collectives over a whole module before any unit exists (the
    wrapper's ``sync_module_states`` broadcast), compared by name, shape,
    dtype and ``requires_grad``. ``groups``: a mesh's axis groups, shard
    axis first. See [Note: model fingerprints].
    """
    if not named or all(g.size() == 1 for g in groups) or os.environ.get(_ENV, "1") == "0":
        return
    entries = [
        _param_entry(name, tuple(t.shape), t.dtype, t.requires_grad).replace(
            "parameter", "parameter" if isinstance(t, torch.nn.Parameter) else "buffer", 1
        )
        for name, t in named
    ]
    _check_groups(entries, groups, named[0][1].device, api)


def _digest(entries: list[str]) -> list[int]:
    sha = hashlib.sha256("\n".join(entries).encode()).digest()
    words = [int.from_bytes(sha[i * 8 : i * 8 + 8], "little", signed=True) for i in range(3)]
    return [*words[:_DIGEST_WORDS], len(entries)]


def _check_groups(
    entries: list[str], groups: Sequence[dist.ProcessGroup], device: torch.device, api: str
) -> None:
    """Compare digests over each axis group in turn; every rank of the mesh reaches one verdict.

    On a 2-D mesh a rank whose own row and column agree must still raise when
    another row differs inside: each exchange carries a flag "my earlier
    groups differed", so after the shard-axis then the replicate-axis
    exchange every rank knows (each column holds one rank of every row).
    """
    digest = _digest(entries)
    flagged = 0
    seen: list[tuple[dist.ProcessGroup, list[tuple[int, ...]], list[int]]] = []
    for group in groups:
        if group.size() == 1:
            continue
        mine = torch.tensor([*digest, flagged], dtype=torch.int64, device=device)
        gathered = torch.empty(group.size() * mine.numel(), dtype=torch.int64, device=device)
        # Straight to torch, not through shard_comms: a set-up exchange, kept out of
        # the per-step collective counters and profiler ranges.
        dist.all_gather_single(gathered, mine, group=group)
        rows = gathered.view(group.size(), -1).tolist()
        digests = [tuple(row[:-1]) for row in rows]
        flags = [row[-1] for row in rows]
        if len(set(digests)) > 1 or any(flags):
            flagged = 1
        seen.append((group, digests, flags))
    if not flagged:
        return
    # Error path only. Every rank of a group saw the same digests, so the
    # object exchanges below pair up (shard axis first, as above).
    message = ""
    for group, digests, _ in seen:
        if len(set(digests)) == 1:
            continue
        described: list[list[str] | None] = [None] * group.size()
        dist.all_gather_object(described, entries, group=group)
        ranks = dist.get_process_group_ranks(group)
        message = message or _message([d or [] for d in described], digests, ranks, api)
    if not message:
        group, _, flags = seen[-1]
        ranks = dist.get_process_group_ranks(group)
        reporting = [r for r, f in zip(ranks, flags, strict=True) if f]
        message = (
            f"{api}: the ranks do not hold the same model: {_ranks(reporting)} found "
            f"{'a difference within its' if len(reporting) == 1 else 'differences within their'} "
            "shard group (the error there names the first difference and the ranks). "
            "Every rank must build the same model (names, shapes, dtypes, requires_grad) and "
            "shard the same modules in the same order."
        )
    raise ModelMismatchError(message)


def _message(
    described: list[list[str]], digests: list[tuple[int, ...]], ranks: list[int], api: str
) -> str:
    # The larger side (ties: the side of the group's first rank) is "expected".
    counts = Counter(digests)
    expected = max(counts, key=lambda d: (counts[d], -digests.index(d)))
    same = [r for r, d in zip(ranks, digests, strict=True) if d == expected]
    first_other = next(i for i, d in enumerate(digests) if d != expected)
    other_digest = digests[first_other]
    other = [r for r, d in zip(ranks, digests, strict=True) if d == other_digest]
    left = described[ranks.index(same[0])]
    right = described[first_other]
    index = next(
        (i for i, (a, b) in enumerate(zip(left, right, strict=False)) if a != b),
        min(len(left), len(right)),
    )
    units_left = [e for e in left if e.startswith("unit ")]
    units_right = [e for e in right if e.startswith("unit ")]
    if units_left != units_right:
        # A different wrap plan shifts every later parameter: name the unit first.
        at = next(
            (i for i, (a, b) in enumerate(zip(units_left, units_right, strict=False)) if a != b),
            min(len(units_left), len(units_right)),
        )
        lines = [
            f"{api}: the ranks do not shard the model into the same units (their wrap plans "
            f"differ): at unit {at} in order, {_ranks(same)} {_has(same)} "
            f"{_entry(units_left, at)}, but {_ranks(other)} {_has(other)} "
            f"{_entry(units_right, at)}. Units in order on {_ranks(same)}: "
            f"{_labels(units_left)}; on {_ranks(other)}: {_labels(units_right)}.",
        ]
    else:
        lines = [
            f"{api}: the ranks do not hold the same model: {_ranks(same)} {_has(same)} "
            f"{_entry(left, index)}, but {_ranks(other)} {_has(other)} {_entry(right, index)} "
            "(the first difference, in unit order).",
        ]
    remaining = sorted(set(ranks) - set(same) - set(other))
    if remaining:
        lines.append(f"{_ranks(remaining)} {'differs' if len(remaining) == 1 else 'differ'} too.")
    lines.append(
        "Every rank must build the same model (names, shapes, dtypes, requires_grad) and "
        "shard the same modules in the same order: look for model code, a wrap policy or "
        "a load that depends on the rank; nothing was communicated yet, so no collective "
        "was left half-way."
    )
    return " ".join(lines)


def _entry(entries: list[str], index: int) -> str:
    return entries[index] if index < len(entries) else "nothing there (its list ends)"


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks))}"


def _has(ranks: list[int]) -> str:
    return "has" if len(ranks) == 1 else "have"


def _labels(unit_entries: list[str]) -> str:
    return "[" + ", ".join(e.removeprefix("unit ") for e in unit_entries) + "]"
