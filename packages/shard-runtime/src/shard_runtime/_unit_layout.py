"""How one unit's parameters live in the buffers its collectives move.

The engine (:class:`~shard_runtime._unit.Unit`) decides when a unit gathers,
frees and reduces, on which stream, over which group; a :class:`UnitLayout`
decides where the bytes are. Two layouts implement it:

- per-parameter (``fully_shard``): every parameter is its own ``Shard(0)``
  DTensor; the all-gather input is the concatenation of each parameter's
  padded shard, and the gathered buffer is copied out into one full tensor
  per parameter (``_per_param_layout.py``);
- flat (``FullyShardedDataParallel``): the unit's parameters are one flat
  buffer sharded by element range; the all-gather lands directly in the flat
  unsharded buffer the original parameters are views of (``_flat_buffer_layout.py``).

Both see the all-gather output as ``(world, gather_numel)``: row ``r`` is what
rank ``r`` sent. The reduce input has the same shape over the trainable
parameters, so that a reduce-scatter leaves each rank its own row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

from shard_core.errors import LayoutError

__all__ = [
    "GradPresence",
    "ParamFacts",
    "ReplacementCheck",
    "UnitLayout",
    "check_one_dtype",
    "merge_presence",
]

# Which trainable parameters had a gradient on this rank when a reduction was issued, in
# the layout's order; ``None``: the layout does not tell (every parameter counts as sent).
GradPresence = tuple[bool, ...] | None


def check_one_dtype(where: str, dtypes: Sequence[tuple[str, torch.dtype]], fix: str) -> None:
    """Raise unless every parameter of a unit has one dtype (one collective moves them all).

    ``where`` starts the message (the front end and the unit), ``dtypes``
    names each parameter's dtype, ``fix`` says what to do in that front end.
    ``LayoutError`` is a ``ValueError``, as PyTorch's FSDP raises for a flat
    parameter of mixed dtypes.
    """
    distinct = {dtype for _, dtype in dtypes}
    if len(distinct) <= 1:
        return
    listed = ", ".join(f"{fqn} ({str(dtype).removeprefix('torch.')})" for fqn, dtype in dtypes)
    raise LayoutError(
        f"{where}: the parameters of one unit are gathered in one dtype, but they mix "
        f"{len(distinct)}: {listed}; {fix}"
    )


def merge_presence(first: GradPresence, second: GradPresence) -> GradPresence:
    """The presence of two reductions summed into one: a gradient in either counts."""
    if first is None or second is None:
        return None
    return tuple(a or b for a, b in zip(first, second, strict=True))


# ``check(fqn, new, old)`` raises unless ``new`` may replace the sharded parameter ``old``.
ReplacementCheck = Callable[[str, object, torch.nn.Parameter], None]


class ParamFacts(NamedTuple):
    """What every rank must agree on about one parameter (see ``_fingerprint.py``)."""

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


class UnitLayout(Protocol):
    """One unit's parameters, sharded and unsharded; see the module docstring."""

    @property
    def fqns(self) -> list[str]:
        """Qualified names of the parameters, for messages."""
        ...

    @property
    def is_empty(self) -> bool:
        """Whether the unit manages no parameter (a root whose children hold them all)."""
        ...

    @property
    def num_trainable(self) -> int:
        """How many gradient-ready signals one backward produces."""
        ...

    @property
    def signals_every_param(self) -> bool:
        """Whether the gradient-ready signals cover every parameter, frozen ones included.

        Then a backward that signalled them all has used every weight of the
        unit; otherwise a frozen weight may still be needed after the last
        signal. See [Note: post-backward when the unit's backward is done] in
        ``_state.py``.
        """
        ...

    @property
    def grad_dtypes(self) -> list[torch.dtype]:
        """The dtype of each reduction's gradients, one per bucket a backward reduces.

        One entry unless the trainable parameters compute in several dtypes;
        see [Note: one reduction per gradient dtype] in ``_per_param_layout.py``.
        """
        ...

    @property
    def gather_dtype(self) -> torch.dtype:
        """The dtype of the last all-gather: the compute dtype, or ``uint8`` for bytes."""
        ...

    @property
    def gather_numel(self) -> int:
        """Elements (of ``gather_dtype``) each rank contributed to the last all-gather."""
        ...

    def registered_params(self) -> list[torch.nn.Parameter]:
        """Every parameter object the group registers on its modules, either face."""
        ...

    def source_versions(self) -> tuple[int, ...]:
        """The version counters of what a gather reads: the shards, and the parameters a
        user or an optimizer writes them through.

        See [Note: a kept unsharded copy is checked before reuse] in ``_unit.py``.
        """
        ...

    def face_versions(self) -> tuple[int, ...]:
        """The version counters of the unsharded parameters registered while unsharded.

        Empty where the modules compute with views nobody else reaches (the
        flat layout).
        """
        ...

    def write_back_faces(self, kept: tuple[int, ...]) -> bool:
        """Carry what was written to the registered unsharded parameters since their
        versions were ``kept`` into this rank's shards (its own rows of each).

        Returns whether something was written and carried, so that the copy
        is stale. ``False`` where nothing was written, or where some write
        could not be carried exactly (it warns): the unit then keeps its copy,
        so the write holds until the unit reshards.
        """
        ...

    def set_label(self, label: str) -> None:
        """Name the parameters under the unit's qualified name ``label``."""
        ...

    def init_compute(
        self,
        param_dtype: torch.dtype | None,
        device: torch.device,
        on_grad_ready: Callable[[torch.Tensor], None],
    ) -> None:
        """(Re)build the unsharded face in ``param_dtype`` (``None``: as sharded) on ``device``.

        ``on_grad_ready`` is called once per trainable leaf when its gradient
        has been accumulated in a backward.
        """
        ...

    def meta_fqns(self) -> list[str]:
        """Parameters whose shards are still on the meta device."""
        ...

    def gather_input(self, device: torch.device) -> torch.Tensor:
        """This rank's all-gather input (1-D, on ``device``); sets gather_numel and gather_dtype."""
        ...

    def gather_output(self, world: int, device: torch.device) -> torch.Tensor:
        """Where the all-gather writes: 1-D, ``world * gather_numel``."""
        ...

    def gather_input_in_output(
        self, world: int, rank: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An all-gather output with this rank's input already in row ``rank``, and that row.

        ``None`` when the layout gathers from a separate input
        (:meth:`gather_input` into :meth:`gather_output`). Sets
        gather_numel and gather_dtype as :meth:`gather_input` does.
        """
        ...

    def finish_gather(self, gathered: torch.Tensor) -> None:
        """Make the full parameters from ``gathered`` and register them on the modules."""
        ...

    def copy_gathered_rows(self, rows: slice, out: torch.Tensor) -> None:
        """Copy rows ``rows`` of the full ``(world, gather_numel)`` buffer into ``out``."""
        ...

    def to_sharded(self) -> None:
        """Register the sharded parameters and release the unsharded storage."""
        ...

    @property
    def hides_params_while_unsharded(self) -> bool:
        """Whether the modules hold plain views instead of their parameters while unsharded.

        ``named_parameters()`` then lacks them until the unit reshards; see
        [Note: an evaluation forward reshards hidden parameters] in ``_state.py``.
        """
        ...

    def show_params_beside_views(self) -> None:
        """A forward left the unit unsharded: list its parameters again, keep the views.

        Only where :attr:`hides_params_while_unsharded`; see [Note: a forward whose
        backward may never come] in ``_state.py``.
        """
        ...

    def release_frozen_grads(self) -> None:
        """Drop the gradients frozen parameters kept (zeros from
        ``zero_grad(set_to_none=False)``), where the front end's PyTorch counterpart
        does: the wrapper when a reduction lands and at the end of some forwards."""
        ...

    def has_unsharded_grads(self) -> bool:
        """Whether any full gradient waits to be reduced."""
        ...

    def keep_grads(self, dtype: torch.dtype | None) -> None:
        """A backward without gradient sync ended: keep the full gradients for the next one.

        ``dtype`` is the reduce dtype the policy asks for (``None``: none); see
        [Note: gradients kept across backwards without sync] in
        ``_per_param_layout.py``.
        """
        ...

    def drop_unsharded_grads(self) -> None:
        """Forget every full gradient not reduced yet (a step abandoned after an error).

        Reductions already issued are not the layout's: see ``_reduction.py``.
        """
        ...

    def reduce_input(
        self, world: int, dtype: torch.dtype, device: torch.device, bucket: int = 0
    ) -> tuple[torch.Tensor, GradPresence]:
        """Bucket ``bucket``'s full gradients as a 1-D ``world * reduce_numel`` buffer, padded.

        The full gradients are released; the buffer is scratch for the
        collective. Returned with which parameters had a gradient, which
        :meth:`accumulate` needs when the reduction lands.
        """
        ...

    def reduce_numel(self, bucket: int = 0) -> int:
        """Elements of one rank's reduced gradient shard of bucket ``bucket``."""
        ...

    def accumulate(
        self, output: torch.Tensor, presence: GradPresence, *, zero_unused: bool, bucket: int = 0
    ) -> None:
        """Add the reduced gradient shard ``output`` of ``bucket`` to the sharded gradients.

        ``presence`` is what :meth:`reduce_input` returned (merged over the
        reductions summed into ``output``). A parameter no rank sent a gradient
        for keeps ``grad`` ``None``, as in PyTorch, unless ``zero_unused``
        (``reduce_scatter_unused_params``) gives it zeros.
        """
        ...

    def describe_params(self, label: str) -> list[ParamFacts]:
        """Every parameter's name (under the unit's ``label``), full shape, dtype and flag."""
        ...

    def adopt_replaced_params(self, check: ReplacementCheck) -> bool:
        """Adopt sharded parameters the user registered in place of the layout's own.

        ``check(fqn, new, old)`` raises unless ``new`` can stand in for
        ``old``. Returns whether anything was adopted (the caller then
        rebuilds the unsharded face). See [Note: parameters replaced before
        the first forward] in ``_state.py``; a layout that registers no
        sharded parameters adopts nothing.
        """
        ...

    def requires_grad_changed(self) -> bool:
        """Whether the user changed a parameter's ``requires_grad`` since the last sync."""
        ...

    def sync_requires_grad(self) -> None:
        """Train exactly the parameters whose ``requires_grad`` is set now.

        Called before a forward of the unit; see [Note: requires_grad is read at
        every forward] in ``_per_param_layout.py``.
        """
        ...

    def reset_after_apply(self) -> None:
        """Adopt new sharded tensors after ``module._apply`` (``.to()``, ``to_empty()``)."""
        ...
