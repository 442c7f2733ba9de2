"""The flat layout of ``FullyShardedDataParallel``: one flat buffer per unit.

The unit's parameters lie back to back in one 1-D buffer (shard-core's
:class:`~shard_core.FlatLayout`); rank ``r`` holds elements ``[r * n, (r + 1) * n)``
of it, ``n = ceil(total / world)``, zero-padded at the end. The all-gather
writes straight into the flat unsharded buffer and the original parameters
are views of it, so gathering costs no copy at all when the shard is already
in the compute dtype and on the compute device; gradients arrive in the flat
buffer's ``.grad`` through those views and are reduce-scattered as they are.

Two faces, as in PyTorch's wrapper:

- ``use_orig_params=False``: the unit registers one ``nn.Parameter``, the
  flat shard (``_flat_param``), on its wrapper; the original parameters are
  removed from their modules and come back as plain tensor views only while
  the unit is unsharded for compute (as ``nn.Parameter`` views inside
  ``summon_full_params``, which users read and edit by name). In between,
  each module holds a shape-only placeholder (a meta tensor of the
  parameter's full shape and dtype) under the parameter's name, so that
  ``print(model)`` and shape checks work, as with PyTorch's wrapper; reading
  values needs ``summon_full_params``.
- ``use_orig_params=True``: the original ``nn.Parameter`` objects stay (the
  optimizer holds them). Between steps each one's ``.data`` is its 1-D piece
  of the local shard (possibly empty) and its ``.grad`` the matching piece of
  the reduced gradient; while the unit computes, the modules see views of the
  flat unsharded buffer instead. On a shard axis of one rank (NO_SHARD,
  or a world of one) each piece is the whole parameter and keeps its full
  shape (see [Note: Unsharded original shapes]).

[Note: Unsharded original shapes]
PyTorch's wrapper gives ``use_orig_params=True`` parameters their original
shapes whenever the flat buffer is not split (NO_SHARD, or one rank), and
their gradients too; user code (weight tying checks, custom init, optimizers
with shape-dependent state) relies on it. The piece is then a view of the
whole parameter's slice of the shard, so nothing else changes: the shard
stays the storage, and code that walks the shard reshapes pieces by numel.

[Note: Alignment of original parameters]
With ``use_orig_params=True`` each original parameter starts at a multiple
of 16 bytes of the buffer the unit computes with, as in PyTorch's wrapper
(compiled kernels want aligned views): the alignment counts elements of the
compute dtype (mixed precision's ``param_dtype``, 8 elements for bf16), not
of the stored one, so the layout (and the ``LOCAL_STATE_DICT`` shapes) are
PyTorch's with mixed precision too.

[Note: Writes under autograd's eye]
The all-gather writes into the flat unsharded parameter, whose views autograd
may have saved during forward; the values written are the ones it saved, so
the writes go through ``.data``, an alias with a version counter of its own,
and autograd's checks never see them.

[Note: Compute views]
While the unit computes, each original parameter is a view of the flat
unsharded parameter made by one ``split_with_sizes`` (padding a piece of its
own only where there is some), as in PyTorch's wrapper: autograd then brings
the views' gradients back as one ``cat`` into one flat gradient. One
``narrow`` per parameter would cost a zero-filled flat-sized gradient per
parameter and an add for each in every backward (measured: that was most of
the wrapper's CPU time over PyTorch's), and an empty padding piece a
zero-fill of its own. A multi-output view may not be used once its base was
written in place; the all-gather writes through ``.data`` (see [Note: Writes
under autograd's eye]), which autograd does not see, so the forward's views
stay valid for backward. The views (and the shape-only placeholders between
steps) go straight into the module's ``__dict__``: the parameter was taken
out of ``_parameters`` and the name is no buffer or submodule, so that is
exactly what ``nn.Module.__setattr__`` would do, without its checks on every
gather and free (two per parameter per step).

[Note: an unsplit unit reduces the gradient it holds]
Accumulating over micro-batches that each reduce (no ``no_sync()``), a unit
whose buffer is split adds each newly reduced shard to the gradient it holds,
as PyTorch's wrapper does for its sharded strategies. Where the buffer is not
split (NO_SHARD, one rank), PyTorch's wrapper lets autograd add the new
gradient into the reduced one it holds and all-reduces the sum. Both give the
mean of the micro-batches' gradients, but rounded differently; to give
PyTorch's values bit for bit, an unsplit unit adds what it holds into the new
gradient before the reduction and the result replaces it. Only where nothing
is cast on the way (the held gradient has the gradient's and the reduction's
dtype); with a mixed-precision ``param_dtype`` the new gradient is reduced
alone and added, in the held gradient's dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from shard_core import FlatLayout, ParamSpec
from shard_runtime._param import ParamOwner
from shard_runtime._storage import alloc_storage, free_storage
from shard_runtime._unit_layout import GradPresence, ParamFacts, ReplacementCheck

__all__ = ["FlatBufferLayout", "FlatParamSpec"]


@dataclass(frozen=True, slots=True)
class FlatParamSpec:
    """One original parameter of a flat unit: its name, object and where it is registered."""

    fqn: str
    param: nn.Parameter
    owners: list[ParamOwner]


class FlatBufferLayout:
    """A :class:`~shard_runtime._unit_layout.UnitLayout` over one flat buffer (module doc)."""

    def __init__(
        self,
        specs: list[FlatParamSpec],
        *,
        rank: int,
        world: int,
        shard_device: torch.device,
        use_orig_params: bool,
        keep_low_precision_grads: bool = False,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.specs = specs
        self.rank = rank
        self.world = world
        self.use_orig_params = use_orig_params
        self.keep_low_precision_grads = keep_low_precision_grads
        self.requires_grad = any(s.param.requires_grad for s in specs)
        self._on_grad_ready: Callable[[torch.Tensor], None] | None = None
        # The reduction in flight carries the reduced gradient held before it: see
        # [Note: an unsplit unit reduces the gradient it holds].
        self._held_grads_folded = False
        self.flat_param: nn.Parameter | None = None
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        self._views_registered = False
        self._placeholders: list[torch.Tensor] = []  # use_orig_params=False; full shapes, meta
        # - the compute views' one split: sizes, and which pieces are parameters
        self._split_sizes: list[int] = []
        self._split_pieces: list[int] = []
        self.unsharded = torch.empty(0)
        self.unsharded_param = nn.Parameter(torch.empty(0), requires_grad=False)
        if not specs:
            # A unit whose children hold every parameter (a root over wrapped blocks).
            self.flat_layout: FlatLayout | None = None
            self.shard = torch.empty(0, device=shard_device)
            return
        dtype = specs[0].param.dtype
        # See [Note: Alignment of original parameters].
        element = torch.empty((), dtype=compute_dtype or dtype).element_size()
        alignment = max(1, 16 // element) if use_orig_params else 1
        self.flat_layout = FlatLayout.from_specs(
            [ParamSpec(s.fqn, tuple(s.param.shape)) for s in specs],
            dtype=dtype,
            device=specs[0].param.device,
            alignment=alignment,
        )
        self._split_sizes, self._split_pieces = _compute_split(self.flat_layout, world)
        device = specs[0].param.device
        shard_device = device if device.type == "meta" else shard_device
        n = self.flat_layout.shard_numel(world)
        self.shard = torch.zeros(n, dtype=dtype, device=shard_device)
        if device.type != "meta":
            with torch.no_grad():
                self.flat_layout.shard(
                    [s.param.detach() for s in specs], rank, world, out=self.shard
                )
        self.shard_meta = self.flat_layout.shard_metadata(rank, world)
        if use_orig_params:
            self._point_orig_params_at_shard()
        else:
            self.flat_param = nn.Parameter(self.shard, requires_grad=self.requires_grad)
            for spec in specs:
                for owner in spec.owners:
                    owner.module._parameters.pop(owner.name, None)
            # Keep no reference to the full originals: every rank would otherwise hold
            # the whole unsharded model (tools/bench/README.md, shard_fsdp1 memory).
            self.specs = [
                FlatParamSpec(spec.fqn, _shape_only(spec.param), spec.owners) for spec in specs
            ]
            self._register_placeholders()

    # ------------------------------------------------------------------ facts

    @property
    def fqns(self) -> list[str]:
        return [s.fqn for s in self.specs]

    @property
    def is_empty(self) -> bool:
        return self.flat_layout is None

    @property
    def num_trainable(self) -> int:
        return 1 if self.requires_grad else 0

    @property
    def hides_params_while_unsharded(self) -> bool:
        # The original parameters give way to views (see [Note: Compute views]); flat ones
        # stay registered on the wrapper.
        return self.use_orig_params and self.flat_layout is not None

    @property
    def signals_every_param(self) -> bool:
        # Every original is a view of the flat buffer: while it trains, frozen originals'
        # views carry a gradient too, so the buffer's one signal comes after all of them.
        return self.flat_layout is None or self.requires_grad

    @property
    def grad_dtypes(self) -> list[torch.dtype]:
        return [self.gather_dtype]

    @property
    def gather_dtype(self) -> torch.dtype:
        return self.unsharded_param.dtype

    @property
    def gather_numel(self) -> int:
        return self.shard.numel()

    def reduce_numel(self, bucket: int = 0) -> int:
        return self.shard.numel()

    def registered_params(self) -> list[nn.Parameter]:
        params = [s.param for s in self.specs]
        return [self.flat_param, *params] if self.flat_param is not None else params

    def source_versions(self) -> tuple[int, ...]:
        # The originals hold views of the shard (with use_orig_params) but count their own
        # writes: assigning ``.data`` does not share the shard's counter.
        return (self.shard._version, *(p._version for p in self.registered_params()))

    def face_versions(self) -> tuple[int, ...]:
        return ()  # the unsharded buffer is reached only through the compute views

    def write_back_faces(self, kept: tuple[int, ...]) -> bool:
        return False  # no face: nothing was written

    def set_label(self, label: str) -> None:
        pass  # the flat unit's messages name its parameters, which keep their own names

    def meta_fqns(self) -> list[str]:
        return self.fqns if self.shard.device.type == "meta" else []

    def describe_params(self, label: str) -> list[ParamFacts]:
        if self.flat_layout is None:
            return []
        # The flat layout keeps full shapes: with use_orig_params the parameters themselves
        # are views of this rank's shard by now.
        dtype = self.flat_layout.dtype
        return [
            ParamFacts(
                f"{label}.{spec.fqn}" if label else spec.fqn,
                tuple(shape.shape),
                dtype,
                spec.param.requires_grad,
            )
            for spec, shape in zip(self.specs, self.flat_layout.params, strict=True)
        ]

    def adopt_replaced_params(self, check: ReplacementCheck) -> bool:
        return False  # the wrapper registers views of its buffer, not sharded parameters

    # ------------------------------------------------------------------ compute face

    def init_compute(
        self,
        param_dtype: torch.dtype | None,
        device: torch.device,
        on_grad_ready: Callable[[torch.Tensor], None],
    ) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.flat_layout is None:
            return
        self._on_grad_ready = on_grad_ready
        dtype = param_dtype or self.shard.dtype
        self.unsharded = torch.empty(self.world * self.shard.numel(), dtype=dtype, device=device)
        self.unsharded_param = nn.Parameter(self.unsharded, requires_grad=False)
        free_storage(self.unsharded)
        self.sync_requires_grad()

    def _user_requires_grad(self) -> bool:
        """Whether any parameter the user sees trains: the flat one, or any original."""
        if self.flat_param is not None:
            return self.flat_param.requires_grad
        return any(s.param.requires_grad for s in self.specs)

    def requires_grad_changed(self) -> bool:
        return self.flat_layout is not None and self._user_requires_grad() != self.requires_grad

    def sync_requires_grad(self) -> None:
        # The flat buffer trains while any original parameter does; a frozen original's piece
        # of the reduced gradient is dropped in ``accumulate``. See [Note: requires_grad is
        # read at every forward] in _per_param_layout.py.
        if self.flat_layout is None:
            return
        self.requires_grad = self._user_requires_grad()
        self.unsharded_param.requires_grad_(self.requires_grad)
        if self.requires_grad and self._hook is None:
            assert self._on_grad_ready is not None, "init_compute first"
            hook = self.unsharded_param.register_post_accumulate_grad_hook
            self._hook = hook(self._on_grad_ready)  # type: ignore[no-untyped-call]
        if self._views_registered:
            # Kept unsharded since a forward (see [Note: a forward whose backward may never
            # come] in _state.py): views taken while the buffer was frozen carry no
            # gradient to it, so the next forward gets new ones.
            self._register_unsharded_views()

    def reset_after_apply(self) -> None:
        """Adopt what ``module._apply`` did to the shard (a new dtype or device)."""
        if self.flat_layout is None:
            return
        current = self.flat_param
        if current is not None and current.data.data_ptr() != self.shard.data_ptr():
            self.shard = current.data
            self._register_placeholders()  # in the new dtype
        elif self.use_orig_params:
            moved = [s.param for s in self.specs if s.param.numel() > 0]
            if moved and (
                moved[0].dtype != self.shard.dtype or moved[0].device != self.shard.device
            ):
                self.shard = self.shard.to(dtype=moved[0].dtype, device=moved[0].device)
                self._point_orig_params_at_shard()

    # ------------------------------------------------------------------ gather

    def gather_input(self, device: torch.device) -> torch.Tensor:
        if self.shard.dtype == self.gather_dtype and self.shard.device == device:
            return self.shard
        return self.shard.to(device=device, dtype=self.gather_dtype, non_blocking=True)

    def gather_output(self, world: int, device: torch.device) -> torch.Tensor:
        alloc_storage(self.unsharded)
        # ``.data`` aliases the storage with a version counter of its own, so the
        # collective's writes never reach the one autograd checks.
        return self.unsharded_param.data

    def gather_input_in_output(
        self, world: int, rank: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None  # the shard is sent as it is, into the unsharded buffer: no copy at all

    def finish_gather(self, gathered: torch.Tensor) -> None:
        if gathered.data_ptr() != self.unsharded.data_ptr():
            alloc_storage(self.unsharded)
            self.unsharded_param.data.copy_(gathered)
        self._register_unsharded_views()

    def _register_unsharded_views(self) -> None:
        assert self.flat_layout is not None
        # See [Note: Compute views].
        with torch.enable_grad():
            pieces = torch.split_with_sizes(self.unsharded_param, self._split_sizes)
            views = [
                pieces[index].view(param.shape)
                for index, param in zip(self._split_pieces, self.flat_layout.params, strict=True)
            ]
        for spec, view in zip(self.specs, views, strict=True):
            for owner in spec.owners:
                owner.module._parameters.pop(owner.name, None)
                # A plain tensor attribute: autograd flows through it to the flat parameter.
                owner.module.__dict__[owner.name] = view
        self._views_registered = True

    def show_params_beside_views(self) -> None:
        if not (self.use_orig_params and self._views_registered):
            return
        # The views stay in ``__dict__``, which attribute lookup reads before
        # ``_parameters``: the modules (and a backward's recomputation) compute with them,
        # while ``named_parameters()`` lists the original objects again.
        for spec in self.specs:
            for owner in spec.owners:
                owner.module._parameters[owner.name] = spec.param

    def copy_gathered_rows(self, rows: slice, out: torch.Tensor) -> None:
        out.copy_(self.unsharded.view(self.world, -1)[rows])

    def to_sharded(self) -> None:
        if self.flat_layout is None:
            return
        if self._views_registered:
            if self.use_orig_params:
                for spec in self.specs:
                    for owner in spec.owners:
                        owner.module.__dict__.pop(owner.name, None)
                        owner.module._parameters[owner.name] = spec.param
            else:
                self._register_placeholders()  # replaces the views in ``__dict__``
            self._views_registered = False
        free_storage(self.unsharded)

    @contextmanager
    def full_precision_views(self, full: torch.Tensor) -> Iterator[None]:
        """Register views of ``full`` (a gathered full-precision flat buffer) as the parameters.

        Each is an ``nn.Parameter`` in its module's ``_parameters``, as with
        PyTorch's wrapper inside ``summon_full_params``, so ``named_parameters()``
        lists the original parameters with their full shapes and in-place edits
        land in ``full``: the original objects with ``use_orig_params``, one new
        parameter per original (shared by all of its owners) otherwise.
        """
        views = self.full_views(full)
        for spec, view in zip(self.specs, views, strict=True):
            if self.use_orig_params:
                spec.param.data = view
                param = spec.param
            else:
                param = nn.Parameter(view, requires_grad=spec.param.requires_grad)
            for owner in spec.owners:
                owner.module.__dict__.pop(owner.name, None)  # the shape-only placeholder
                owner.module._parameters[owner.name] = param
        try:
            yield
        finally:
            for spec in self.specs:
                for owner in spec.owners:
                    if not self.use_orig_params:
                        owner.module._parameters.pop(owner.name, None)
                    owner.module.__dict__.pop(owner.name, None)
            if self.use_orig_params:
                self._point_orig_params_at_shard()
            else:
                self._register_placeholders()

    # ------------------------------------------------------------------ reduce

    def has_unsharded_grads(self) -> bool:
        return self.unsharded_param.grad is not None

    def keep_grads(self, dtype: torch.dtype | None) -> None:
        pass  # the flat gradient accumulates as autograd computes it, as in PyTorch's wrapper

    def drop_unsharded_grads(self) -> None:
        self.unsharded_param.grad = None

    def reduce_input(
        self, world: int, dtype: torch.dtype, device: torch.device, bucket: int = 0
    ) -> tuple[torch.Tensor, GradPresence]:
        grad = self.unsharded_param.grad
        assert grad is not None
        self.unsharded_param.grad = None
        self._held_grads_folded = self.world == 1 and self._fold_held_grads(grad, dtype)
        # One gradient for the whole buffer: frozen originals' pieces are sent as they are.
        return (grad if grad.dtype == dtype else grad.to(dtype)), None

    def _fold_held_grads(self, grad: torch.Tensor, dtype: torch.dtype) -> bool:
        """Add the reduced gradients held from an earlier backward into ``grad``, unsplit.

        See [Note: an unsplit unit reduces the gradient it holds]. Returns
        whether they were folded in (nothing held counts as folded).
        """
        if grad.dtype != dtype:
            return False
        held = self._held_grads()
        if any(h.dtype != grad.dtype or h.device != grad.device for _, h in held):
            return False
        for offset, tensor in held:
            grad.narrow(0, offset, tensor.numel()).add_(tensor.reshape(-1))
        return True

    def _held_grads(self) -> list[tuple[int, torch.Tensor]]:
        """The reduced gradients this rank holds, with their offsets in the unsharded buffer."""
        if self.flat_param is not None:
            grad = self.flat_param.grad
            return [] if grad is None else [(0, grad)]
        return [
            (info.offset_in_range, spec.param.grad)
            for spec, info in zip(self.shard_specs(), self.shard_meta.params, strict=True)
            if spec.param.grad is not None and spec.param.requires_grad
        ]

    def accumulate(
        self, output: torch.Tensor, presence: GradPresence, *, zero_unused: bool, bucket: int = 0
    ) -> None:
        dtype = self.gather_dtype if self.keep_low_precision_grads else self.shard.dtype
        reduced = output.to(device=self.shard.device, dtype=dtype)
        replace = self._held_grads_folded  # the reduction holds them already
        self._held_grads_folded = False
        if self.flat_param is not None:
            if self.flat_param.grad is None or replace:
                _set_grad(self.flat_param, reduced)  # a fresh buffer per reduction: adopt it
            else:
                self.flat_param.grad.add_(reduced)
            return
        self.release_frozen_grads()
        for spec, info in zip(self.shard_specs(), self.shard_meta.params, strict=True):
            if not spec.param.requires_grad:
                continue
            piece = reduced.narrow(0, info.offset_in_range, info.numel_in_range)
            piece = piece.view(spec.param.shape)  # 1-D, or the full shape on one rank
            if spec.param.grad is None or replace:
                _set_grad(spec.param, piece.clone())
            else:
                spec.param.grad.add_(piece)

    def release_frozen_grads(self) -> None:
        if self.flat_param is not None or self.flat_layout is None:
            return  # the originals have no gradients of their own, or there are none
        for spec in self.shard_specs():
            if not spec.param.requires_grad:
                # As PyTorch's wrapper: a frozen parameter loses any gradient it kept (zeros
                # from zero_grad(set_to_none=False), say), so the optimizer stops stepping
                # it (momentum, weight decay).
                spec.param.grad = None

    # ------------------------------------------------------------------ helpers

    def full_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One single-output view per parameter, for ``summon_full_params``.

        Not ``split``: users edit summoned parameters in place, which autograd
        forbids on views of a multi-output op.
        """
        assert self.flat_layout is not None
        # The layout keeps the full shapes (``param.shape`` is the shard piece's).
        return [
            flat.narrow(0, offset, spec.numel).view(spec.shape)
            for spec, offset in zip(self.flat_layout.params, self.flat_layout.offsets, strict=True)
        ]

    def _orig_shape(self, index: int) -> torch.Size:
        assert self.flat_layout is not None
        return torch.Size(self.flat_layout.params[index].shape)

    def shard_specs(self) -> list[FlatParamSpec]:
        return [self.specs[info.index] for info in self.shard_meta.params]

    def _register_placeholders(self) -> None:
        """``use_orig_params=False``, sharded: shape-only stand-ins for the parameters."""
        assert self.flat_layout is not None
        if not self._placeholders or self._placeholders[0].dtype != self.shard.dtype:
            self._placeholders = [
                torch.empty(spec.shape, dtype=self.shard.dtype, device="meta")
                for spec in self.flat_layout.params
            ]
        for spec, placeholder in zip(self.specs, self._placeholders, strict=True):
            for owner in spec.owners:
                # See [Note: Compute views]: a plain attribute, as ``setattr`` would make it.
                owner.module.__dict__[owner.name] = placeholder

    def _point_orig_params_at_shard(self) -> None:
        """``use_orig_params``: each original parameter's data is its piece of the shard."""
        assert self.flat_layout is not None
        pieces = dict(
            zip(
                (info.index for info in self.shard_meta.params),
                self.flat_layout.shard_views(self.shard, self.rank, self.world),
                strict=True,
            )
        )
        empty = self.shard.new_empty(0)
        for index, spec in enumerate(self.specs):
            piece = pieces.get(index, empty)
            # See [Note: Unsharded original shapes]
            spec.param.data = piece.view(self._orig_shape(index)) if self.world == 1 else piece
            for owner in spec.owners:
                owner.module._parameters[owner.name] = spec.param


def _compute_split(layout: FlatLayout, world: int) -> tuple[list[int], list[int]]:
    """Sizes splitting the unsharded flat buffer into parameters and padding, and the indices
    of the parameters' pieces.

    Padding between parameters and at the end is a piece of its own where it is
    not empty, and only then: autograd zero-fills a gradient for every piece no
    gradient reached. See [Note: Compute views].
    """
    sizes: list[int] = []
    pieces: list[int] = []
    end = 0
    for spec, offset in zip(layout.params, layout.offsets, strict=True):
        if offset > end:
            sizes.append(offset - end)
        pieces.append(len(sizes))
        sizes.append(spec.numel)
        end = offset + spec.numel
    padded = layout.padded_numel(world)
    if padded > end:
        sizes.append(padded - end)
    return sizes, pieces


def _set_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    """``param.grad = grad``, also where ``keep_low_precision_grads`` makes it another dtype.

    Autograd refuses a gradient whose dtype is not the parameter's; PyTorch's
    wrapper swaps the low-precision data in behind a gradient of the right
    dtype, and so does this (the optimizer then sees the low-precision one).
    """
    if grad.dtype == param.dtype:
        param.grad = grad
        return
    param.grad = torch.empty((), dtype=param.dtype, device=grad.device).expand(grad.shape)
    param.grad.data = grad


def _shape_only(param: nn.Parameter) -> nn.Parameter:
    """A stand-in with ``param``'s shape, dtype and ``requires_grad``, and no storage."""
    return nn.Parameter(
        torch.empty(param.shape, dtype=param.dtype, device="meta"),
        requires_grad=param.requires_grad,
    )
