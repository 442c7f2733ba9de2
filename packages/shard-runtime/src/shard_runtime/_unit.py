"""A unit: the parameters one ``fully_shard`` call manages, communicated together.

The unit is the engine's single communication object: one all-gather brings
all of its parameters in, one reduce-scatter (plus one all-reduce across
replicas on a 2-D mesh) sends all of its gradients out. Front ends decide
*when* (hooks, prefetch, reshard policy); the unit decides *how*.

All-gather layout: every rank contributes one flat buffer, the concatenation
of its padded shard of each parameter (``padded_rows * row_numel`` elements
each). The gathered buffer is ``(world, per_rank)``; column block ``i`` of it
is parameter ``i``'s padded full tensor, copied out in one
``split_with_sizes_copy``. Reduce-scatter uses the same layout in reverse, over
the trainable parameters only.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shard_comms import CommHandle, all_gather, all_reduce, default_divide_factors, reduce_scatter
from shard_core.protocols import EventLike
from shard_runtime._comm import streams_for
from shard_runtime._options import MixedPrecisionPolicy
from shard_runtime._param import ShardedParam

__all__ = ["PendingReduce", "ShardedState", "TrainingState", "Unit"]


class ShardedState(enum.Enum):
    """Which face of the unit's parameters is registered."""

    # Sharded DTensor parameters registered; unsharded storage released.
    SHARDED = enum.auto()
    # Full parameters registered and holding data (forward/backward compute).
    UNSHARDED = enum.auto()
    # After forward with an int reshard_after_forward: sharded parameters
    # registered, and a shard over the smaller post-forward group kept for the
    # backward all-gather.
    SHARDED_POST_FORWARD = enum.auto()


@dataclass(frozen=True, slots=True)
class PostForwardGroup:
    """The smaller group a unit reshards to after forward (``reshard_after_forward=int``).

    The shard axis of ``world`` ranks is cut into consecutive groups of
    ``size`` ranks; this rank is member ``index`` of its group and keeps
    ``world // size`` of the full all-gather's per-rank blocks, the ones at
    ``[index * rows, (index + 1) * rows)``. Gathering those over the group
    rebuilds exactly the full all-gather's output.
    """

    group: dist.ProcessGroup
    size: int
    index: int
    rows: int


class TrainingState(enum.Enum):
    """Where the unit is in the step."""

    # Between steps, or outside forward and backward.
    IDLE = enum.auto()
    # Inside the unit's forward.
    FORWARD = enum.auto()
    # Backward has reached the unit's outputs: parameters gathered for its backward.
    PRE_BACKWARD = enum.auto()
    # The unit's gradients were reduced (or kept, without gradient sync).
    POST_BACKWARD = enum.auto()


@dataclass(slots=True)
class PendingReduce:
    """A gradient reduction in flight; :meth:`finish` lands it in the sharded gradients."""

    work: CommHandle
    finish_fn: Callable[[], None]
    keep_alive: tuple[torch.Tensor, ...] = ()  # collective inputs, held until it completes
    done: bool = False

    def finish(self) -> None:
        """Wait for the collective and accumulate the result, once."""
        if self.done:
            return
        self.work.wait()
        self.keep_alive = ()
        self.finish_fn()
        self.done = True


@dataclass(slots=True)
class _PendingGather:
    work: CommHandle
    output: torch.Tensor  # 1D, world * per_rank
    send: torch.Tensor  # 1D, per_rank: the input, held until the collective completes
    issued: EventLike  # end of the copy-in and the collective call on the all-gather stream


@dataclass(eq=False)
class Unit:
    """The engine's communication group; see the module docstring."""

    label: str
    params: list[ShardedParam]
    mesh: DeviceMesh
    mp_policy: MixedPrecisionPolicy
    compute_device: torch.device
    # - state
    sharded_state: ShardedState = ShardedState.SHARDED
    training_state: TrainingState = TrainingState.IDLE
    # - per-step switches, set through FSDPModule
    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True
    reshard_after_backward: bool = True
    post_forward: PostForwardGroup | None = None
    # - communication in flight
    _pending_gather: _PendingGather | None = None
    _post_forward_shard: torch.Tensor | None = None  # 1D, rows * per_rank
    _partial_reduce: torch.Tensor | None = None  # 1D, reduce-scattered but not all-reduced
    _grads_ready: int = 0
    _post_event: EventLike | None = None
    _grad_hooks: list[torch.utils.hooks.RemovableHandle] = field(default_factory=list)
    on_all_grads_ready: Callable[[Unit], None] | None = None

    def __post_init__(self) -> None:
        self.shard_group: dist.ProcessGroup = self.mesh.get_group(self.mesh.ndim - 1)
        self.replicate_group: dist.ProcessGroup | None = (
            self.mesh.get_group(0) if self.mesh.ndim == 2 else None
        )
        self.shard_world = self.mesh.size(-1)
        self.replicate_world = self.mesh.size(0) if self.mesh.ndim == 2 else 1
        self.trainable = [p for p in self.params if p.requires_grad]
        self.streams = streams_for(self.compute_device)
        self._init_compute_dtype()

    @property
    def comm_label(self) -> str:
        """The unit's name in profiles, logs and collective counts (``root`` for the root)."""
        return self.label or "root"

    def set_label(self, label: str) -> None:
        """Name the unit by its module's qualified name (and its parameters under it)."""
        self.label = label
        for p in self.params:
            p.fqn = f"{label}.{p.local_name}" if label else p.local_name

    # ------------------------------------------------------------------ dtypes

    def _init_compute_dtype(self) -> None:
        """(Re)build every unsharded face in the compute dtype and hook its gradient."""
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks = []
        for p in self.params:
            dtype = self.mp_policy.param_dtype or p.padded_shard.dtype
            p.init_unsharded(dtype, self.compute_device)
            if p.requires_grad:
                self._grad_hooks.append(
                    p.unsharded_param.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                        self._on_grad_ready
                    )
                )
        dtypes = {p.unsharded_param.dtype for p in self.params}
        self.gather_dtype: torch.dtype | None = next(iter(dtypes)) if len(dtypes) == 1 else None
        if len(dtypes) > 1:
            names = ", ".join(f"{p.fqn} ({p.unsharded_param.dtype})" for p in self.params)
            raise TypeError(
                f"fully_shard({self.label or 'root'}): parameters of one unit must share a dtype "
                f"to be all-gathered together, got {names}; give MixedPrecisionPolicy("
                "param_dtype=...) or shard the differently typed submodule separately"
            )

    def reset_after_apply(self) -> None:
        """Adopt new sharded tensors after ``module._apply`` (``.to()``, ``to_empty()``)."""
        for p in self.params:
            p.reset_sharded_param()
        self._init_compute_dtype()

    def _reduce_dtype(self) -> torch.dtype:
        assert self.gather_dtype is not None or not self.params
        return self.mp_policy.reduce_dtype or self.gather_dtype or torch.float32

    # ------------------------------------------------------------------ unshard

    def unshard(self, *, async_op: bool = False) -> None:
        """Start (or, with ``async_op=False``, complete) the all-gather of this unit."""
        if self.sharded_state is ShardedState.UNSHARDED or self._pending_gather is not None:
            if not async_op:
                self.wait_for_unshard()
            return
        if not self.params:
            self.sharded_state = ShardedState.UNSHARDED
            return
        self._check_materialized()
        assert self.gather_dtype is not None
        # See [Note: Stream ordering] in _comm.py.
        streams = self.streams
        stream = streams.all_gather
        if self._post_event is not None:
            stream.wait_event(self._post_event)
            self._post_event = None
        else:
            stream.wait_stream(streams.current())
        per_rank = sum(p.padded_numel for p in self.params)
        with streams.handle.stream(stream):
            if self._post_forward_shard is not None:
                assert self.post_forward is not None
                send, group = self._post_forward_shard, self.post_forward.group
            else:
                send, group = self._copy_in_shards(per_rank), self.shard_group
            output = torch.empty(
                per_rank * self.shard_world, dtype=self.gather_dtype, device=self.compute_device
            )
            work = all_gather(output, send, group, async_op=True, label=self.comm_label)
            issued = stream.record_event()
        self._pending_gather = _PendingGather(work, output, send, issued)
        if not async_op:
            self.wait_for_unshard()

    def _copy_in_shards(self, per_rank: int) -> torch.Tensor:
        send = torch.empty(per_rank, dtype=self.gather_dtype, device=self.compute_device)
        offset = 0
        for p in self.params:
            send[offset : offset + p.padded_numel].view_as(p.padded_shard).copy_(p.padded_shard)
            offset += p.padded_numel
        return send

    def wait_for_unshard(self) -> None:
        """Finish a started all-gather and register the full parameters."""
        pending = self._pending_gather
        if pending is None:
            if self.sharded_state is not ShardedState.UNSHARDED and self.params:
                self.unshard()
            return
        self._pending_gather = None
        current = self.streams.current()
        pending.issued.wait(current)
        pending.work.wait()
        self.streams.handle.record_stream(pending.output, current)
        for p in self.params:
            p.alloc_unsharded()
        outs = [p.unsharded_rows_view() for p in self.params]
        gathered = pending.output.view(self.shard_world, -1)
        # See [Note: version counters] in _param.py.
        with torch.no_grad(), _preserve_versions([p.unsharded_param for p in self.params]):
            if len(outs) == 1:
                outs[0].copy_(gathered)
            else:
                torch.split_with_sizes_copy(
                    gathered, [p.padded_numel for p in self.params], dim=1, out=outs
                )
        for p in self.params:
            p.to_unsharded()
        self._post_forward_shard = None
        self.sharded_state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        """Register the sharded parameters again and release the full ones."""
        if self._pending_gather is not None:
            self.wait_for_unshard()
        for p in self.params:
            p.to_sharded()
            p.free_unsharded()
        self._post_forward_shard = None
        self.sharded_state = ShardedState.SHARDED

    def reshard_post_forward(self) -> None:
        """Reshard after forward: fully, or to the smaller post-forward group when one is set."""
        pf = self.post_forward
        if pf is None or self.sharded_state is not ShardedState.UNSHARDED or not self.params:
            self.reshard()
            return
        per_rank = sum(p.padded_numel for p in self.params)
        kept = torch.empty(pf.rows * per_rank, dtype=self.gather_dtype, device=self.compute_device)
        columns = kept.view(pf.rows, per_rank)
        rows = slice(pf.index * pf.rows, (pf.index + 1) * pf.rows)
        offset = 0
        for p in self.params:
            columns[:, offset : offset + p.padded_numel].copy_(p.unsharded_rows_view()[rows])
            offset += p.padded_numel
        self.reshard()
        self._post_forward_shard = kept
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    def _check_materialized(self) -> None:
        on_meta = [p.fqn for p in self.params if p.padded_shard.device.type == "meta"]
        if on_meta:
            raise RuntimeError(
                f"fully_shard({self.label or 'root'}): parameters are still on the meta device: "
                f"{', '.join(on_meta)}; call module.to_empty(device=...) and initialize them "
                "before the first forward"
            )

    # ------------------------------------------------------------------ gradients

    def _on_grad_ready(self, _param: torch.Tensor) -> None:
        self._grads_ready += 1
        if self._grads_ready == len(self.trainable) and self.on_all_grads_ready is not None:
            self.on_all_grads_ready(self)

    def reset_backward(self) -> None:
        """Forget this backward's gradient bookkeeping."""
        self._grads_ready = 0

    def has_unsharded_grads(self) -> bool:
        """Whether any full gradient waits to be reduced."""
        return any(p.unsharded_param.grad is not None for p in self.trainable)

    def reduce_grads(self) -> PendingReduce | None:
        """Issue the reduce-scatter of this unit's full gradients; ``None`` if there are none.

        The result is averaged over every data-parallel rank (shard x replicate).
        """
        if not self.has_unsharded_grads():
            return None
        reduce_dtype = self._reduce_dtype()
        world = self.shard_world
        per_rank = sum(p.padded_numel for p in self.trainable)
        pre, post = default_divide_factors(world * self.replicate_world)
        # See [Note: Stream ordering] in _comm.py.
        streams = self.streams
        stream = streams.reduce_scatter
        current = streams.current()
        stream.wait_stream(current)
        with streams.handle.stream(stream):
            full = torch.empty(world * per_rank, dtype=reduce_dtype, device=self.compute_device)
            columns = full.view(world, per_rank)
            offset = 0
            for p in self.trainable:
                grad = p.unsharded_param.grad
                if grad is not None:
                    streams.handle.record_stream(grad, stream)
                _copy_padded_rows(columns[:, offset : offset + p.padded_numel], grad, p)
                p.unsharded_param.grad = None
                offset += p.padded_numel
            output = torch.empty(per_rank, dtype=reduce_dtype, device=self.compute_device)
            work = reduce_scatter(
                output,
                full,
                self.shard_group,
                pre_divide=pre,
                post_divide=post if self.replicate_group is None else 1.0,
                async_op=True,
                label=self.comm_label,
            )
            done = stream.record_event()

        def finish() -> None:
            done.wait(streams.current())
            if self.replicate_group is not None:
                if self._partial_reduce is not None:
                    output.add_(self._partial_reduce)
                    self._partial_reduce = None
                if not self.requires_all_reduce:
                    self._partial_reduce = output
                    return
                all_reduce(
                    output,
                    self.replicate_group,
                    pre_divide=1.0,
                    post_divide=post,
                    label=self.comm_label,
                ).wait()
            self._accumulate(output)

        return PendingReduce(work, finish, keep_alive=(full,))

    def _accumulate(self, output: torch.Tensor) -> None:
        offset = 0
        for p in self.trainable:
            local = output[offset : offset + p.local_rows * p.row_numel]
            p.accumulate_sharded_grad(local.view(p.local_rows, *p.full_shape[1:]))
            offset += p.padded_numel


def _copy_padded_rows(block: torch.Tensor, grad: torch.Tensor | None, p: ShardedParam) -> None:
    """Write ``grad`` (``dim0`` rows) into ``block`` (``world x padded_numel``), zero-padded."""
    if grad is None:
        block.zero_()
        return
    rows = p.padded_rows
    dim0 = p.full_shape[0]
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


class _preserve_versions:
    """Hide in-place writes to ``tensors`` from autograd's saved-tensor checks."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        preserve = torch.autograd._unsafe_preserve_version_counter  # type: ignore[attr-defined]
        self._contexts = [preserve(t) for t in tensors]

    def __enter__(self) -> None:
        for ctx in self._contexts:
            ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        for ctx in reversed(self._contexts):
            ctx.__exit__(*exc)
