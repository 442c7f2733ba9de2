"""The per-parameter layout of ``fully_shard``: one ``Shard(dim)`` DTensor per parameter.

All-gather layout: every rank contributes the concatenation of its padded
shard of each parameter (``padded_numel`` elements each). The gathered buffer
is ``(world, gather_numel)``; column block ``i`` of it is parameter ``i``'s
padded full tensor (its local tensor, for a tensor-parallel parameter), rank
by rank. When every parameter is sharded on dim 0 (the default) those blocks
are copied out in one ``split_with_sizes_copy``; a parameter sharded on
another dim (``shard_placement_fn``) has its blocks interleaved along that dim
(:meth:`ShardedParam.write_gathered`). The reduction uses the same layout over
the trainable parameters; the shards are already padded in place
(``padded_dim0_size`` rows each, shard-core's dim-0 math).

[Note: requires_grad is read at every forward]
Fine-tuning freezes and unfreezes parameters after the model was sharded
(progressive unfreezing, a LoRA base frozen late). The flag the user sets is
the sharded parameter's, so the layout reads it again before each forward of
the unit (:meth:`PerParamLayout.sync_requires_grad`, as PyTorch reads it at
each all-gather): the unsharded face gets the same flag, so autograd computes
a gradient exactly for the parameters that train now; the reduction covers
those parameters only (a frozen one is neither sent nor given a gradient);
and a parameter that starts to train gets its gradient-ready hook then. While
a unit is unsharded the user reaches the unsharded faces, and a flag set
there is kept too ([Note: the face the user sets] in ``_param.py``).

[Note: gradients kept across backwards without sync]
A backward without gradient sync (``set_requires_gradient_sync(False)``,
gradient accumulation over micro-batches) keeps the full gradients for the
next one to add to. Autograd accumulates in the compute dtype; with a reduce
dtype set by the mixed-precision policy, the kept gradient is converted to it
once (:meth:`ShardedParam.keep_grad`) and each later backward's gradient is
added to it in that dtype (:meth:`ShardedParam.fold_grad`), so bf16 compute
with fp32 reduction sums the micro-batches in fp32, as PyTorch does.

[Note: one all-gather, many dtypes]
A unit's parameters need not share a dtype: an fp32 LoRA adapter beside a
bf16 base, or tensor subclasses whose ``fsdp_pre_all_gather`` sends several
tensors of their own dtypes (NF4: ``uint8`` data, an ``int8`` and a float
scale). When everything a unit sends has one dtype the all-gather moves that
dtype, as before; otherwise it moves bytes: each tensor is viewed as
``uint8`` and the pieces are concatenated, so the unit still issues one
collective and the bytes on the wire are exactly the tensors' bytes (what
PyTorch sends for subclasses). Float8 tensors always travel as bytes, because
gloo cannot all-gather float8 dtypes. The plan of the last gather (dtype and
each piece's size) is what :meth:`PerParamLayout.finish_gather` splits by.

[Note: the all-gather input is a row of its output]
Each rank's contribution is copied once, from its padded shards, straight
into its own row of the all-gather's output, and the collective is issued in
place (PyTorch's FSDP2 does the same). A separate input buffer would hold
another ``gather_numel`` elements while every all-gather (and every backward
prefetch) is in flight, and cost one more allocation per gather, for the
same copy. gloo and NCCL both accept an input that is the output's own row.

[Note: one unsharded storage per unit]
The padded unsharded buffers of a unit's parameters lie back to back in one
storage, which is grown before the all-gather's copy-out and released at
reshard for all of them at once: one allocation per gather instead of one
per parameter (202 storage resizes per step on the benchmark's GPT, now 20),
and one block of memory the allocator can hand back whole. Each parameter's
buffer is still a tensor of its own on that storage (``Tensor.set_``), not a
view of one unit tensor, so the parameters keep independent version counters,
as they have in PyTorch's FSDP2: an in-place write to one never trips
autograd's saved-tensor check of another. Units whose parameters compute in
several dtypes, or that hold tensor subclasses with their own all-gather,
keep one storage per parameter.

[Note: the reduce input in one copy]
The reduce input is ``(world, reduce_numel)``: row ``r`` holds, parameter
after parameter, the rows of each full gradient that rank ``r`` keeps,
zero-padded to ``padded_rows`` (the all-gather's layout). When every
gradient of the bucket is there (not empty) in one dtype and split on dim 0,
``torch._chunk_cat`` writes exactly that in one operator for the unit (what
PyTorch's FSDP2 calls for its copy-in) where no gradient needs padding and
none needs a cast. With padding ``_chunk_cat`` builds padded copies of the
whole gradients first: at 1,024 ranks, where padding is 9x the parameters,
that raised the step's peak 16% above ``shard plan``'s estimate
(``test_step_peak_is_within_five_percent_of_a_simulated_rank``). The cast is
left on the per-parameter path as not measured. Otherwise each
parameter's block is written on its own (``_copy_padded_rows``: zeros for a
parameter without gradient, strided blocks for another dim).

[Note: one reduction per gradient dtype]
Gradients are summed, so they cannot travel as bytes. A unit whose trainable
parameters compute in several dtypes issues one reduce-scatter per dtype, each
in its own dtype (a bucket of the parameters of that dtype, in the unit's
order); with ``MixedPrecisionPolicy(reduce_dtype=...)`` there is one bucket in
that dtype. PyTorch 2.13 refuses such units; with one dtype there is one
bucket, the same single reduce-scatter as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from shard_runtime._options import MixedPrecisionPolicy
from shard_runtime._param import ShardedParam
from shard_runtime._storage import alloc_storage, free_storage
from shard_runtime._unit_layout import (
    GradPresence,
    ParamFacts,
    ReplacementCheck,
)

__all__ = ["PerParamLayout"]


class PerParamLayout:
    """A :class:`~shard_runtime._unit_layout.UnitLayout` of :class:`ShardedParam` s."""

    def __init__(
        self,
        params: list[ShardedParam],
        label: str,
        *,
        mp_policy: MixedPrecisionPolicy | None = None,
    ) -> None:
        self.params = params
        self._mp_policy = mp_policy  # what a five-argument fsdp_pre_all_gather is handed
        self.trainable = [p for p in params if p.requires_grad]
        self._label = label
        # - gradient-ready hooks, by index in ``params``; see [Note: requires_grad is read at
        #   every forward]
        self._hooks: dict[int, torch.utils.hooks.RemovableHandle] = {}
        self._on_grad_ready: Callable[[torch.Tensor], None] | None = None
        self._all_dim0 = all(p.shard_dim == 0 for p in params)
        # - the last gather's plan (see [Note: one all-gather, many dtypes]); sizes in
        #   elements of the gather's dtype, per parameter and per tensor it sends
        self._gather_dtype: torch.dtype | None = None
        self._gather_sizes: list[list[int]] = []
        self._gather_numel = sum(p.padded_numel for p in params)
        # - fixed for the group's life (a re-adopted shard keeps its padded shape)
        self._padded_numels = [p.padded_numel for p in params]
        # - the trainable parameters by reduction; see [Note: one reduction per gradient dtype]
        self._buckets: list[list[ShardedParam]] = [self.trainable]
        self._reduce_numels = [sum(p.padded_numel for p in self.trainable)]
        self._grad_dtypes: list[torch.dtype] = []
        # - every parameter's padded unsharded buffer, back to back (None: one storage per
        #   parameter); see [Note: one unsharded storage per unit]
        self._unsharded: torch.Tensor | None = None  # 1D
        # - built once per init_compute for the plain copy-out: each parameter's
        #   (world, padded_numel) view of its unsharded buffer, and the tensors whose version
        #   counters a gather preserves; None: rebuilt per gather (tensor subclasses)
        self._copy_out: list[torch.Tensor] | None = None
        self._versions: list[torch.Tensor] | None = None

    # ------------------------------------------------------------------ facts

    @property
    def fqns(self) -> list[str]:
        return [p.fqn for p in self.params]

    @property
    def is_empty(self) -> bool:
        return not self.params

    @property
    def hides_params_while_unsharded(self) -> bool:
        return False  # the unsharded faces are registered Parameters

    def show_params_beside_views(self) -> None:
        pass  # nothing is hidden

    @property
    def num_trainable(self) -> int:
        return len(self.trainable)

    @property
    def signals_every_param(self) -> bool:
        return len(self.trainable) == len(self.params)

    @property
    def gather_dtype(self) -> torch.dtype:
        assert self._gather_dtype is not None, "gather_input first"
        return self._gather_dtype

    @property
    def gather_numel(self) -> int:
        return self._gather_numel

    def reduce_numel(self, bucket: int = 0) -> int:
        return self._reduce_numels[bucket]

    @property
    def grad_dtypes(self) -> list[torch.dtype]:
        assert self._grad_dtypes or not self.trainable, "init_compute first"
        return self._grad_dtypes

    def registered_params(self) -> list[torch.nn.Parameter]:
        return [param for p in self.params for param in (p.sharded_param, p.unsharded_param)]

    def source_versions(self) -> tuple[int, ...]:
        return tuple(version for p in self.params for version in p.shard_versions())

    def release_frozen_grads(self) -> None:
        pass  # frozen parameters keep their gradients, as FSDP2's (and a plain model's)

    def face_versions(self) -> tuple[int, ...]:
        # A gather's writes keep the counters (see [Note: version counters] in _param.py),
        # so only the user's writes move them.
        return tuple(p.unsharded_param._version for p in self.params)

    def write_back_faces(self, kept: tuple[int, ...]) -> bool:
        written = [
            p
            for p, version in zip(self.params, kept, strict=True)
            if p.unsharded_param._version != version
        ]
        return bool(written) and all([p.write_back_own_rows() for p in written])  # each, then all

    def set_label(self, label: str) -> None:
        self._label = label
        for p in self.params:
            p.fqn = f"{label}.{p.local_name}" if label else p.local_name

    def meta_fqns(self) -> list[str]:
        return [p.fqn for p in self.params if p.padded_shard.device.type == "meta"]

    # ------------------------------------------------------------------ compute face

    def describe_params(self, label: str) -> list[ParamFacts]:
        return [
            ParamFacts(p.fqn, tuple(p.full_shape), p.sharded_param.dtype, p.requires_grad)
            for p in self.params
        ]

    def adopt_replaced_params(self, check: ReplacementCheck) -> bool:
        adopted = False
        for p in self.params:
            for owner in p.owners:
                current = owner.module._parameters.get(owner.name)
                if current is p.sharded_param or current is p.unsharded_param:
                    continue
                check(p.fqn, current, p.sharded_param)
                assert current is not None
                p.sharded_param = current
                adopted = True
        if adopted:
            for p in self.params:
                p.to_sharded()  # every owner of a tied parameter sees the adopted one
        return adopted

    def init_compute(
        self,
        param_dtype: torch.dtype | None,
        device: torch.device,
        on_grad_ready: Callable[[torch.Tensor], None],
    ) -> None:
        for handle in self._hooks.values():
            handle.remove()
        self._hooks = {}
        self._on_grad_ready = on_grad_ready
        self._init_unsharded(param_dtype, device)
        self._hook_trainable()
        self._plan_buckets()
        self._gather_dtype = None if self.params else torch.float32

    def _init_unsharded(self, param_dtype: torch.dtype | None, device: torch.device) -> None:
        """Every parameter's unsharded face; one storage for the unit where it can be.

        See [Note: one unsharded storage per unit].
        """
        self._copy_out = self._versions = None
        dtypes = {param_dtype or p.padded_shard.dtype for p in self.params}
        if len(dtypes) != 1 or any(p.extension is not None for p in self.params):
            self._unsharded = None
            for p in self.params:
                p.init_unsharded(param_dtype or p.padded_shard.dtype, device)
            return
        dtype = dtypes.pop()
        numels = [p.shard_world * p.padded_numel for p in self.params]
        self._unsharded = torch.empty(sum(numels), dtype=dtype, device=device)
        storage = self._unsharded.untyped_storage()
        offset = 0
        for p, numel in zip(self.params, numels, strict=True):
            p.init_unsharded(dtype, device, storage, offset)
            offset += numel
        free_storage(self._unsharded)
        self._versions = [t for p in self.params for t in p.version_tensors()]
        if self._all_dim0:
            self._copy_out = [p.unsharded_rows_view() for p in self.params]

    def _plan_buckets(self) -> None:
        """Group the trainable parameters by the dtype their gradients reduce in.

        That is the full parameter's dtype: the compute dtype, or what a
        subclass's ``fsdp_post_all_gather`` made. See [Note: one reduction per
        gradient dtype].
        """
        reduce_dtype = None if self._mp_policy is None else self._mp_policy.reduce_dtype
        if reduce_dtype is not None or not self.trainable:
            self._buckets = [self.trainable]
        else:
            by_dtype: dict[torch.dtype, list[ShardedParam]] = {}
            for p in self.trainable:
                by_dtype.setdefault(p.unsharded_param.dtype, []).append(p)
            self._buckets = list(by_dtype.values())
        self._reduce_numels = [sum(p.padded_numel for p in bucket) for bucket in self._buckets]
        self._grad_dtypes = [bucket[0].unsharded_param.dtype for bucket in self._buckets if bucket]

    def reset_after_apply(self) -> None:
        for p in self.params:
            p.reset_sharded_param()

    def requires_grad_changed(self) -> bool:
        return any(p.requires_grad_changed() for p in self.params) or (
            [p for p in self.params if p.requires_grad] != self.trainable
        )

    def sync_requires_grad(self) -> None:
        # See [Note: requires_grad is read at every forward].
        for p in self.params:
            p.sync_requires_grad()
        self.trainable = [p for p in self.params if p.requires_grad]
        self._hook_trainable()
        self._plan_buckets()

    def _hook_trainable(self) -> None:
        """Hook each trainable unsharded parameter's gradient (once; frozen ones cannot be)."""
        assert self._on_grad_ready is not None, "init_compute first"
        for index, p in enumerate(self.params):
            if p.requires_grad and index not in self._hooks:
                hook = p.unsharded_param.register_post_accumulate_grad_hook
                self._hooks[index] = hook(self._on_grad_ready)  # type: ignore[no-untyped-call]

    def _rehook(self, index: int) -> None:
        """Hook a parameter whose unsharded face was just rebuilt (an extension's first gather)."""
        handle = self._hooks.pop(index, None)
        if handle is not None:
            handle.remove()
        self._hook_trainable()

    # ------------------------------------------------------------------ gather

    def gather_input(self, device: torch.device) -> torch.Tensor:
        sends, as_bytes = self._plan_gather(device)
        send = torch.empty(self._gather_numel, dtype=self.gather_dtype, device=device)
        self._write_gather_input(sends, as_bytes, send)
        return send

    def gather_input_in_output(
        self, world: int, rank: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # See [Note: the all-gather input is a row of its output].
        sends, as_bytes = self._plan_gather(device)
        numel = self._gather_numel
        output = torch.empty(world * numel, dtype=self.gather_dtype, device=device)
        send = output.narrow(0, rank * numel, numel)
        self._write_gather_input(sends, as_bytes, send)
        return output, send

    def _plan_gather(
        self, device: torch.device
    ) -> tuple[list[list[tuple[torch.Tensor, torch.dtype]]], bool]:
        """What each parameter sends and whether the unit gathers bytes; sets the gather plan.

        See [Note: one all-gather, many dtypes].
        """
        sends: list[list[tuple[torch.Tensor, torch.dtype]]] = []
        for p in self.params:
            if p.extension is not None:
                inputs = p.extension_inputs(device, self._mp_policy)
                sends.append([(t, t.dtype) for t in inputs])
            else:
                sends.append([(p.padded_shard.view(-1), p.compute_dtype)])
        wire = {dtype for per_param in sends for _, dtype in per_param}
        as_bytes = len(wire) > 1 or any(dtype in _BYTES_ONLY for dtype in wire)
        self._gather_dtype = torch.uint8 if as_bytes else wire.pop()
        self._gather_sizes = [
            [t.numel() * (want.itemsize if as_bytes else 1) for t, want in per_param]
            for per_param in sends
        ]
        self._gather_numel = sum(sum(sizes) for sizes in self._gather_sizes)
        return sends, as_bytes

    def _write_gather_input(
        self,
        sends: list[list[tuple[torch.Tensor, torch.dtype]]],
        as_bytes: bool,
        send: torch.Tensor,
    ) -> None:
        """Write every parameter's contribution into ``send`` (1-D, ``gather_numel``)."""
        pieces = [t for per_param in sends for t, _ in per_param]
        dtype = send.dtype
        if not as_bytes and all(t.dtype == dtype and t.device == send.device for t in pieces):
            torch.cat(pieces, out=send)  # one copy op for the unit
            return
        offset = 0
        for per_param, sizes in zip(sends, self._gather_sizes, strict=True):
            for (tensor, want), size in zip(per_param, sizes, strict=True):
                target = send[offset : offset + size]
                if as_bytes:
                    if tensor.dtype != want:
                        tensor = tensor.to(want)
                    target.copy_(tensor.contiguous().view(torch.uint8))
                else:
                    target.copy_(tensor)
                offset += size

    def gather_output(self, world: int, device: torch.device) -> torch.Tensor:
        return torch.empty(world * self.gather_numel, dtype=self.gather_dtype, device=device)

    def finish_gather(self, gathered: torch.Tensor) -> None:
        if self._unsharded is not None:
            alloc_storage(self._unsharded)
        else:
            for p in self.params:
                p.alloc_unsharded()
        world = self.params[0].shard_world
        columns = gathered.view(world, -1)
        versions = self._versions
        if versions is None:
            versions = [t for p in self.params for t in p.version_tensors()]
        plain = self._gather_dtype != torch.uint8 and not any(
            p.extension is not None for p in self.params
        )
        rebuilt: list[int] = []
        # See [Note: version counters] in _param.py.
        with torch.no_grad(), _preserve_versions(versions):
            if plain and len(self.params) == 1:
                self.params[0].write_gathered(columns)
            elif plain and self._all_dim0:
                outs = self._copy_out
                if outs is None:
                    outs = [p.unsharded_rows_view() for p in self.params]
                torch.split_with_sizes_copy(columns, self._padded_numels, dim=1, out=outs)
            else:
                offset = 0
                for index, (p, sizes) in enumerate(
                    zip(self.params, self._gather_sizes, strict=True)
                ):
                    blocks = []
                    for size in sizes:
                        blocks.append(columns[:, offset : offset + size])
                        offset += size
                    if p.extension is None:
                        p.write_gathered(blocks[0])
                    elif p.write_extension_outputs(blocks):
                        rebuilt.append(index)
        for index in rebuilt:
            self._rehook(index)
        if rebuilt:  # a subclass's full tensor may compute in a dtype of its own
            self._plan_buckets()
        for p in self.params:
            p.to_unsharded()

    def copy_gathered_rows(self, rows: slice, out: torch.Tensor) -> None:
        offset = 0
        for p, sizes in zip(self.params, self._gather_sizes, strict=True):
            p.read_gathered(rows, out[:, offset : offset + sizes[0]])
            offset += sizes[0]

    def to_sharded(self) -> None:
        for p in self.params:
            p.to_sharded()
        if self._unsharded is not None:
            free_storage(self._unsharded)
        else:
            for p in self.params:
                p.free_unsharded()

    # ------------------------------------------------------------------ reduce

    def has_unsharded_grads(self) -> bool:
        return any(
            p.unsharded_param.grad is not None or p.accumulated_grad is not None
            for p in self.trainable
        )

    def keep_grads(self, dtype: torch.dtype | None) -> None:
        # See [Note: gradients kept across backwards without sync].
        for p in self.trainable:
            p.keep_grad(dtype)

    def drop_unsharded_grads(self) -> None:
        for p in self.params:
            p.drop_unsharded_grads()

    def reduce_input(
        self, world: int, dtype: torch.dtype, device: torch.device, bucket: int = 0
    ) -> tuple[torch.Tensor, GradPresence]:
        per_rank = self.reduce_numel(bucket)
        full = torch.empty(world * per_rank, dtype=dtype, device=device)
        columns = full.view(world, per_rank)
        params = self._buckets[bucket]
        grads: list[torch.Tensor | None] = []
        for p in params:
            p.fold_grad()
            grads.append(p.unsharded_grad())
        present = [g for g in grads if g is not None and g.dim() and g.numel()]
        flat = (
            [g.reshape(-1) if p.flat else g for p, g in zip(params, present, strict=True)]
            if len(present) == len(params) and self._all_dim0
            else []
        )
        if flat and all(g.dtype == dtype and g.size(0) % world == 0 for g in flat):
            # See [Note: the reduce input in one copy].
            torch._chunk_cat(flat, 0, world, out=columns)
        else:
            offset = 0
            for p, grad in zip(params, grads, strict=True):
                _copy_padded_rows(columns[:, offset : offset + p.padded_numel], grad, p)
                offset += p.padded_numel
        for p in params:
            p.drop_unsharded_grads()
        return full, tuple(g is not None for g in grads)

    def accumulate(
        self, output: torch.Tensor, presence: GradPresence, *, zero_unused: bool, bucket: int = 0
    ) -> None:
        params = self._buckets[bucket]
        offset = 0
        with_grad = presence if presence is not None else (True,) * len(params)
        for p, has_grad in zip(params, with_grad, strict=True):
            # The real rows lead the padded block (padding exists only on dim 0).
            local_shape = p.local_shape
            local = output[offset : offset + local_shape.numel()]
            offset += p.padded_numel
            if not has_grad and not zero_unused and not bool(local.any()):
                # No rank sent a gradient for this shard (its zeros only kept the layout):
                # keep grad None, as PyTorch does, so the optimizer leaves it alone. Where
                # another rank's forward used the parameter, the reduced shard holds its
                # contribution and is accumulated, so shards of one parameter never disagree.
                # The check syncs with the host, only for parameters without a local grad.
                continue
            p.accumulate_sharded_grad(local.view(local_shape))


def _copy_padded_rows(block: torch.Tensor, grad: torch.Tensor | None, p: ShardedParam) -> None:
    """Write ``grad`` (``dim0`` rows) into ``block`` (``world x padded_numel``), zero-padded."""
    if grad is None:
        block.zero_()
        return
    if p.shard_dim != 0:  # evenly split: rank r's block is slice r along the dim
        block.view(block.shape[0], *p.padded_shape).copy_(p.unsharded_blocks(grad))
        return
    if p.flat:
        grad = grad.reshape(-1)
    rows = p.padded_rows
    dim0 = p.split_shape[0]
    world = block.shape[0]
    if dim0 == rows * world:
        block.copy_(grad.reshape(world, p.padded_numel))
        return
    block.zero_()
    if rows == 0:
        return
    full_ranks = dim0 // rows
    if full_ranks:
        block[:full_ranks].copy_(grad[: full_ranks * rows].reshape(full_ranks, p.padded_numel))
    rest = dim0 - full_ranks * rows
    if rest:
        block[full_ranks, : rest * p.row_numel].copy_(grad[full_ranks * rows :].reshape(-1))


# Dtypes some backends cannot all-gather (gloo has no float8): a unit holding them gathers bytes.
_BYTES_ONLY = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)


class _preserve_versions:
    """Hide in-place writes to ``tensors`` from autograd's saved-tensor checks.

    One context for all of them (the unit's parameters), not one per tensor.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        preserve = torch.autograd._unsafe_preserve_version_counter  # type: ignore[attr-defined]
        self._context = preserve(tuple(tensors))

    def __enter__(self) -> None:
        self._context.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._context.__exit__(*exc)
