"""Single-process reference training for parity tests.

A parity test trains the same model on the same data twice: sharded over N
ranks, each rank seeing its own slice of every step's batch, and here, in
one process, on each step's whole batch (the ranks' batches concatenated
along dim 0 in rank order). Both runs must then agree step by step.

[Note: Why sharded training must match the reference]
With a mean-reduced loss and equal per-rank batch sizes ``b``, the loss of
the global batch of ``N * b`` samples is the mean of the N per-rank losses,
and its gradient is the mean of the N per-rank gradients, which is exactly
what a reduce-scatter divided by the world size leaves on each rank. So
the sharded run's mean loss and its parameters must equal the reference's
after every step, within fp32 round-off (``torch.testing.assert_close``
default tolerances). Unequal per-rank batch sizes, or sum-reduced losses,
break this identity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "Batch",
    "ReferenceRun",
    "assert_state_dicts_equal",
    "global_batch",
    "make_batches",
    "train_reference",
]

Batch = tuple[torch.Tensor, ...]
"""One rank's batch for one step: the model's positional inputs, then the target, last."""


def make_batches(
    seed: int,
    steps: int,
    world_size: int,
    batch_size: int,
    make_one: Callable[[torch.Generator, int], Batch],
) -> list[list[Batch]]:
    """Deterministic data for a parity test: ``batches[step][rank]``.

    ``make_one(generator, batch_size)`` builds one rank's batch for one step
    from the CPU generator it is given (and no other randomness); it is
    called for step 0 ranks 0..N-1, then step 1, and so on, with one
    generator seeded with ``seed``. The same arguments always give the same
    tensors.

    Raises:
        ValueError: a count is not positive, or ``make_one`` returned
            something other than a tuple of at least two tensors of
            ``batch_size`` rows.
    """
    for name, value in (("steps", steps), ("world_size", world_size), ("batch_size", batch_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    generator = torch.Generator().manual_seed(seed)
    batches: list[list[Batch]] = []
    for step in range(steps):
        per_rank: list[Batch] = []
        for rank in range(world_size):
            batch = make_one(generator, batch_size)
            _check_batch(batch, f"make_one (step {step}, rank {rank})", rows=batch_size)
            per_rank.append(batch)
        batches.append(per_rank)
    return batches


def global_batch(step_batches: Sequence[Batch]) -> Batch:
    """One step's global batch: the ranks' tensors concatenated on dim 0, in rank order."""
    if not step_batches:
        raise ValueError("a step needs the batch of at least one rank, got none")
    arity = len(step_batches[0])
    for rank, batch in enumerate(step_batches):
        _check_batch(batch, f"the batch of rank {rank}", rows=None)
        if len(batch) != arity:
            raise ValueError(
                f"the batch of rank {rank} has {len(batch)} tensors but rank 0's has {arity}; "
                "every rank's batch must hold the same inputs and target"
            )
    return tuple(torch.cat(parts) for parts in zip(*step_batches, strict=True))


@dataclass(frozen=True)
class ReferenceRun:
    """What :func:`train_reference` returns.

    Attributes:
        losses: 1-D tensor, the loss of each step (detached, CPU, in the
            loss's dtype), so that ``assert_close`` applies that dtype's
            tolerances.
        state_dict: The model's state dict after the last step (detached CPU
            copies).
    """

    losses: torch.Tensor
    state_dict: dict[str, torch.Tensor]


def train_reference(
    *,
    model_factory: Callable[[], nn.Module],
    optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    batches: Sequence[Sequence[Batch]],
) -> ReferenceRun:
    """Train one process on each step's global batch.

    See [Note: Why sharded training must match the reference].
    Per step: ``zero_grad``, ``loss_fn(model(*inputs), target)`` on
    :func:`global_batch` of ``batches[step]``, ``backward``, ``step``.
    ``model_factory`` must build the same initial model as the sharded side
    (seed inside it); ``optimizer_factory`` receives ``model.parameters()``.

    Raises:
        ValueError: steps with different numbers of ranks, batches of
            different shapes of tuple, or a loss that is not a scalar.
    """
    model = model_factory()
    optimizer = optimizer_factory(model.parameters())
    losses: list[torch.Tensor] = []
    for step, step_batches in enumerate(batches):
        if len(step_batches) != len(batches[0]):
            raise ValueError(
                f"step {step} has batches for {len(step_batches)} ranks but step 0 has "
                f"{len(batches[0])}; every step needs one batch per rank"
            )
        *inputs, target = global_batch(step_batches)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(*inputs), target)
        if loss.dim() != 0:
            raise ValueError(
                f"loss_fn returned a tensor of shape {tuple(loss.shape)} at step {step}; "
                "it must return a mean-reduced scalar"
            )
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        losses.append(loss.detach().to(device="cpu", copy=True))
    stacked = torch.stack(losses) if losses else torch.empty(0)
    state = {
        name: value.detach().to(device="cpu", copy=True)
        for name, value in model.state_dict().items()
    }
    return ReferenceRun(losses=stacked, state_dict=state)


def assert_state_dicts_equal(
    actual: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Assert two state dicts hold the same keys and, per key, close tensors.

    Tolerances are ``torch.testing.assert_close``'s (its dtype defaults when
    both are ``None``). The message names how many entries differ, the first
    one in ``expected``'s order, and for it the largest absolute difference
    with its index and both values, or the shape or dtype mismatch.

    Raises:
        AssertionError: the keys differ, or some entry differs.
    """
    missing = [key for key in expected if key not in actual]
    unexpected = [key for key in actual if key not in expected]
    if missing or unexpected:
        raise AssertionError(
            f"state dicts have different keys: missing {missing}, unexpected {unexpected}"
        )
    differing: list[str] = []
    first = ""
    for key, want in expected.items():
        detail = _difference(actual[key], want, rtol=rtol, atol=atol)
        if detail is not None:
            if not differing:
                first = detail
            differing.append(key)
    if differing:
        raise AssertionError(
            f"state dicts differ in {len(differing)} of {len(expected)} entries {differing}; "
            f"first {differing[0]!r}: {first}"
        )


def _difference(
    got: torch.Tensor, want: torch.Tensor, *, rtol: float | None, atol: float | None
) -> str | None:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != expected {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} != expected {want.dtype}"
    got = got.detach().cpu()
    want = want.detach().cpu()
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    except AssertionError:
        delta = (got.double() - want.double()).abs()
        flat = int(torch.argmax(torch.nan_to_num(delta, nan=float("inf"))))
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), got.shape))
        return (
            f"max abs difference {delta[index].item():.6g} at index {index} "
            f"(actual {got[index].item()!r}, expected {want[index].item()!r})"
        )
    return None


def _check_batch(batch: object, what: str, *, rows: int | None) -> None:
    if (
        not isinstance(batch, tuple)
        or len(batch) < 2
        or not all(isinstance(t, torch.Tensor) for t in batch)
    ):
        raise ValueError(
            f"{what} must be a tuple of at least two tensors (inputs..., target), got {batch!r}"
        )
    if rows is not None:
        sizes = [t.shape[0] if t.dim() else None for t in batch]
        if any(size != rows for size in sizes):
            raise ValueError(f"{what} returned tensors of {sizes} rows; expected {rows} each")
