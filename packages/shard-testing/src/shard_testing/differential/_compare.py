"""What one library's run records, and how two records are compared.

[Note: What must agree]
After every optimizer step of the same configuration on the same seeds,
PyTorch's FSDP and shard must agree, on every rank, in

- the parameter names (``named_parameters``, wrapper prefixes included:
  a drop-in keeps them),
- each micro-batch's loss, and the validation loss of a forward under
  ``torch.no_grad()`` before the step (when the configuration evaluates),
- the total norm ``clip_grad_norm_`` returns (when the run clips),
- each parameter's gradient before the step, including whether it is
  ``None`` (a frozen or unused parameter),
- each parameter after the step,
- the optimizer state of each parameter after the step,
- and, when a library raises, the step, the phase and the built-in type of
  the exception (``LayoutError`` is a ``ValueError``: ``except ValueError``
  catches both, which is what a user's code sees).

Tensors are each rank's local shards (``DTensor.to_local()``, FSDP1's flat
shards or its original parameters' views of them), so a different layout
shows as a different shape. In fp32 they must be bitwise equal
(``torch.equal``, NaN equal to NaN): both libraries run the same operations
in the same order on the same data. Under mixed precision the compute runs
in bf16 and an operation order that differs (a fused cast, a different
reduction grouping) legitimately changes the last bits, so values compare
within bf16 rounding, scaled by the tensor's magnitude; see :func:`differs`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "Discrepancy",
    "Outcome",
    "Snapshot",
    "Trace",
    "compare_traces",
    "differs",
    "first_discrepancy",
    "signature",
]

BF16_RTOL = 2.0**-5
"""Relative tolerance under mixed precision: 4 bf16 ulps (its epsilon is 2**-7)."""
BF16_ATOL = 2.0**-6
"""Absolute tolerance under mixed precision, times the larger of 1 and the tensor's max |value|."""


@dataclass
class Snapshot:
    """One step of one library on one rank (detached CPU copies of the local shards)."""

    losses: list[torch.Tensor] = field(default_factory=list)
    eval_loss: torch.Tensor | None = None
    state_keys: tuple[str, ...] = ()
    """The state dicts' keys, when the run resumed before this step (``_run._state_keys``)."""
    grad_norm: torch.Tensor | None = None
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    optim: dict[str, dict[str, torch.Tensor | float]] = field(default_factory=dict)


@dataclass
class Trace:
    """One library's run on one rank: the parameter names, a snapshot per step, how it ended.

    ``error`` is ``(step, phase, built-in type name, "Type: message")`` when
    the run raised (``step`` -1 while building), else ``None``.
    """

    names: list[str] = field(default_factory=list)
    steps: list[Snapshot] = field(default_factory=list)
    error: tuple[int, str, str, str] | None = None


@dataclass(frozen=True)
class Discrepancy:
    """One way shard differed from PyTorch, on one rank.

    Attributes:
        rank: where it was seen.
        step: the optimizer step (0-based); -1 for construction.
        what: ``"names"``, ``"loss"``, ``"state_dict keys"``, ``"eval_loss"``,
            ``"grad_norm"``, ``"grad"``, ``"grad is None"``, ``"param"``, ``"optim"`` or
            ``"error"``.
        name: the parameter (clean name) or optimizer state key, if any.
        detail: what PyTorch had and what shard had.
    """

    rank: int
    step: int
    what: str
    name: str
    detail: str

    def __str__(self) -> str:
        where = f"step {self.step}" if self.step >= 0 else "construction"
        subject = f" {self.name}" if self.name else ""
        return f"rank {self.rank}, {where}: {self.what}{subject}: {self.detail}"


@dataclass(frozen=True)
class Outcome:
    """What a rank returns to the pool: plain values only (never tensors).

    Attributes:
        rank: the rank.
        status: ``"ok"`` (both trained every step), ``"both raised ..."``
            (both refused the configuration the same way) or ``"differs"``.
        discrepancies: the first few, in the order found.
        total: how many discrepancies were found (all are not kept).
        seconds: wall time of both runs on this rank.
    """

    rank: int
    status: str
    discrepancies: tuple[Discrepancy, ...]
    total: int
    seconds: float

    def report(self) -> str:
        """The status and the discrepancies, one per line."""
        lines = [f"rank {self.rank}: {self.status} ({self.total} discrepancies)"]
        lines += [f"  {d}" for d in self.discrepancies]
        return "\n".join(lines)


def differs(expected: torch.Tensor, actual: torch.Tensor, *, exact: bool) -> str | None:
    """Why ``actual`` (shard) differs from ``expected`` (PyTorch), or ``None``.

    ``exact``: bitwise (``torch.equal``; NaNs in the same places count as
    equal). Otherwise within ``BF16_RTOL`` and ``BF16_ATOL`` times the larger
    of 1 and ``expected``'s largest magnitude; see [Note: What must agree].
    """
    if expected.shape != actual.shape:
        return f"shape {tuple(expected.shape)} != {tuple(actual.shape)}"
    if expected.dtype != actual.dtype:
        return f"dtype {expected.dtype} != {actual.dtype}"
    if expected.numel() == 0:
        return None
    want, got = expected.double(), actual.double()
    same_nan = torch.equal(want.isnan(), got.isnan())
    want_n, got_n = torch.nan_to_num(want, nan=0.0), torch.nan_to_num(got, nan=0.0)
    if exact:
        if same_nan and torch.equal(want_n, got_n):
            return None
    else:
        scale = max(1.0, float(want_n.abs().max()))
        if same_nan and torch.allclose(got_n, want_n, rtol=BF16_RTOL, atol=BF16_ATOL * scale):
            return None
    delta = (got_n - want_n).abs()
    index = int(torch.argmax(delta))
    flat_want, flat_got = want.flatten(), got.flatten()
    kind = "bitwise" if exact else "beyond bf16 rounding"
    return (
        f"differs {kind}: max |diff| {float(delta.flatten()[index]):.3g} at flat index {index} "
        f"(torch {float(flat_want[index])!r}, shard {float(flat_got[index])!r})"
        + ("" if same_nan else "; NaNs in different places")
    )


_KEEP = 12  # discrepancies a rank sends back; the rest are only counted


def compare_traces(
    expected: Trace, actual: Trace, *, rank: int, exact: bool
) -> tuple[list[Discrepancy], int]:
    """Compare shard's trace (``actual``) with PyTorch's (``expected``).

    Returns the first discrepancies (in step order, up to a dozen) and how
    many there are in all. See [Note: What must agree].
    """
    found = list(_discrepancies(expected, actual, rank=rank, exact=exact))
    return found[:_KEEP], len(found)


def _discrepancies(
    expected: Trace, actual: Trace, *, rank: int, exact: bool
) -> Iterator[Discrepancy]:
    if expected.names != actual.names and expected.error is None and actual.error is None:
        yield Discrepancy(rank, -1, "names", "", f"torch {expected.names} != shard {actual.names}")
    for step, (want, got) in enumerate(zip(expected.steps, actual.steps, strict=False)):
        yield from _step(want, got, rank=rank, step=step, exact=exact)
    if expected.error is not None or actual.error is not None:
        yield from _errors(expected, actual, rank=rank)


def _errors(expected: Trace, actual: Trace, *, rank: int) -> Iterator[Discrepancy]:
    """A discrepancy when one library raised and the other did not, or raised otherwise.

    Its ``name`` says who raised what where (``"shard RuntimeError in backward"``,
    ``"torch ValueError in build, shard none"``): the part of a failure that
    tells two bugs apart, without the message, whose wording differs.
    """
    want, got = expected.error, actual.error
    if want is not None and got is not None and want[:3] == got[:3]:
        return
    torch_side = "none" if want is None else f"{want[2]} in {want[1]}"
    shard_side = "none" if got is None else f"{got[2]} in {got[1]}"
    if want is None:
        name = f"shard {shard_side}"
    elif got is None:
        name = f"torch {torch_side}, shard none"
    else:
        name = f"torch {torch_side}, shard {shard_side}"
    steps = [e[0] for e in (want, got) if e is not None]
    detail = "; ".join(
        f"{who} raised at step {e[0]}: {e[3]}" for who, e in (("torch", want), ("shard", got)) if e
    )
    yield Discrepancy(rank, min(steps), "error", name, detail)


def _step(
    want: Snapshot, got: Snapshot, *, rank: int, step: int, exact: bool
) -> Iterator[Discrepancy]:
    for micro, (a, b) in enumerate(zip(want.losses, got.losses, strict=False)):
        detail = differs(a, b, exact=exact)
        if detail is not None:
            yield Discrepancy(rank, step, "loss", f"micro-batch {micro}", detail)
    if want.state_keys != got.state_keys:
        detail = _key_difference(want.state_keys, got.state_keys)
        yield Discrepancy(rank, step, "state_dict keys", "", detail)
    for what in ("eval_loss", "grad_norm"):
        yield from _optional(
            getattr(want, what), getattr(got, what), rank=rank, step=step, what=what, exact=exact
        )
    for name, grad in want.grads.items():
        other = got.grads.get(name)
        if (grad is None) != (other is None):
            yield Discrepancy(
                rank,
                step,
                "grad is None",
                name,
                f"torch {'None' if grad is None else 'a tensor'}, "
                f"shard {'None' if other is None else 'a tensor'}",
            )
        elif grad is not None and other is not None:
            detail = differs(grad, other, exact=exact)
            if detail is not None:
                yield Discrepancy(rank, step, "grad", name, detail)
    yield from _tensors(want.params, got.params, rank=rank, step=step, what="param", exact=exact)
    for name in sorted(set(want.optim) | set(got.optim)):
        a_state, b_state = want.optim.get(name, {}), got.optim.get(name, {})
        if sorted(a_state) != sorted(b_state):
            yield Discrepancy(
                rank,
                step,
                "optim",
                name,
                f"state keys torch {sorted(a_state)} shard {sorted(b_state)}",
            )
            continue
        for key, a_value in a_state.items():
            b_value = b_state[key]
            if isinstance(a_value, torch.Tensor) and isinstance(b_value, torch.Tensor):
                detail = differs(a_value, b_value, exact=exact)
            elif isinstance(a_value, torch.Tensor) or isinstance(b_value, torch.Tensor):
                detail = f"torch {type(a_value).__name__}, shard {type(b_value).__name__}"
            else:
                detail = None if _same_number(a_value, b_value) else f"{a_value!r} != {b_value!r}"
            if detail is not None:
                yield Discrepancy(rank, step, "optim", f"{name}[{key!r}]", detail)


def _key_difference(want: Sequence[str], got: Sequence[str]) -> str:
    """How shard's state-dict keys differ from PyTorch's: which, or where the order parts."""
    different = _different_names(want, got)
    if different is not None:
        return different
    at = next(i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b)
    return f"same keys, another order: torch has {want[at]!r} at {at}, shard {got[at]!r}"


def _different_names(want: Sequence[str], got: Sequence[str]) -> str | None:
    """``"shard lacks [...], has extra [...]"`` when the two hold different names, else ``None``."""
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        return f"shard lacks {missing}, has extra {extra}"
    return None


def _optional(
    want: torch.Tensor | None,
    got: torch.Tensor | None,
    *,
    rank: int,
    step: int,
    what: str,
    exact: bool,
) -> Iterator[Discrepancy]:
    """A scalar that one library may not have recorded (a norm, a validation loss)."""
    if (want is None) != (got is None):
        yield Discrepancy(rank, step, what, "", "recorded by one library only")
    elif want is not None and got is not None:
        detail = differs(want, got, exact=exact)
        if detail is not None:
            yield Discrepancy(rank, step, what, "", detail)


def _tensors(
    want: Mapping[str, torch.Tensor],
    got: Mapping[str, torch.Tensor],
    *,
    rank: int,
    step: int,
    what: str,
    exact: bool,
) -> Iterator[Discrepancy]:
    different = _different_names(list(want), list(got))
    if different is not None:
        yield Discrepancy(rank, step, what, "", different)
    for name, value in want.items():
        if name in got:
            detail = differs(value, got[name], exact=exact)
            if detail is not None:
                yield Discrepancy(rank, step, what, name, detail)


def _same_number(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def first_discrepancy(outcomes: Sequence[Outcome]) -> Discrepancy | None:
    """The earliest discrepancy of any rank (lowest step, then lowest rank), or ``None``."""
    found = [d for outcome in outcomes for d in outcome.discrepancies]
    return min(found, key=lambda d: (d.step, d.rank), default=None)


def signature(front_end: str, discrepancy: Discrepancy) -> str:
    """What kind of failure ``discrepancy`` is, so that a fuzzer counts each kind once.

    The front end, what differs and, for exceptions, who raised what where:
    ``"wrapper: error (shard RuntimeError in backward)"``, ``"fully_shard: grad"``.
    Coarse on purpose: shrinking keeps the signature, and a finer one (the
    parameter, the step) would keep incidental detail in the shrunk case.
    """
    if discrepancy.what == "error":
        return f"{front_end}: error ({discrepancy.name})"
    return f"{front_end}: {discrepancy.what}"
