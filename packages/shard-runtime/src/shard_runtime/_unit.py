"""A unit: the parameters one ``fully_shard`` call (or one wrapper) manages, communicated together.

The unit is the engine's single communication object: one all-gather brings
all of its parameters in, one reduce-scatter (plus one all-reduce across
replicas on a 2-D mesh) sends all of its gradients out. Front ends decide
*when* (hooks, prefetch, reshard policy); the unit decides *how* (streams,
groups, dtypes, divide factors); its :class:`~shard_runtime._unit_layout.UnitLayout`
decides *where* the bytes live (per-parameter or flat layout).

[Note: Communication controls]
``FSDPModule.set_*`` methods steer how one unit communicates, as PyTorch's do:

- where the gradient is divided. By default the reduction averages over
  every data-parallel rank (shard x replicate), split into a division before
  and one after the sum (see [Note: Divide factors] in shard-comms).
  ``gradient_divide_factor`` divides by that number instead, after the sum.
  ``force_sum_reduction_for_comms`` asks for pure sums on the wire: the
  collectives only add, and the division (by the factor, or by the
  data-parallel size) runs after them, as separate steps (for fp16-like
  reduce dtypes part of it before the sum, against overflow);
- ``all_reduce_hook`` runs on this rank's reduced gradient shard after the
  collectives (after the replica all-reduce on a 2-D mesh, instead of it on a
  1-D one, where a user brings their own replication) and before the division
  ``force_sum_reduction_for_comms`` moved after them, so it sees sums then
  (with an fp16-like reduce dtype it sees the sum divided by the part taken
  before it, as in PyTorch);
- ``unshard_in_backward=False`` skips the all-gather before the unit's
  backward (and backward prefetches of it), for units whose backward needs no
  parameter values (an embedding's gradient needs only the indices);
- ``reduce_scatter_unused_params`` reduces a zero gradient for a unit that
  got none in a backward (every rank then issues the same reduce-scatters);
  parameters without a gradient inside a unit that has some are always sent
  as zeros, so ranks never disagree on a reduce-scatter's size;
- ``reduce_scatter_group`` is a second process group over the shard ranks,
  so reduce-scatters do not queue behind all-gathers on one communicator;
- ``custom_all_gather`` / ``custom_reduce_scatter`` replace the unit's
  collective by a user's object (see shard-comms' ``custom_all_gather``);
- ``comm_allocator`` takes the collectives' buffers from the process group's
  allocator where its backend has one (``"process_group"``, ``"symm_mem"``).

[Note: Comm hooks on the one reduction path]
A comm hook (the wrapper's ``register_comm_hook``) changes one step of the
unit's reduction, the collectives, and nothing else: :meth:`Unit.reduce_grads`
builds the same reducer (:meth:`Unit.grad_reducer`: the unit's groups,
``reduce_scatter_group`` included, its divide plan, its custom reduce-scatter)
and allocates the same buffers on the reduce-scatter stream, then calls either
``reducer.scatter`` (asynchronous) or the hook through ``reduce_gradient``
(synchronous: a hook's result is final when it returns). One ``finish``
follows for both: the deferred replica all-reduce, the all-reduce hook, the
division after it, the accumulation.

On a 2-D mesh the hook is handed the whole reduction (reduce-scatter, then
the replica all-reduce, which a compressing hook then compresses too) only
when that all-reduce runs now with nothing deferred before it. Otherwise,
while ``requires_all_reduce`` is ``False`` and in the first reduction after a
deferral, its reducer has no replicate group: the hook reduce-scatters, and
``finish`` adds the kept partial and runs (or defers again) the replica
all-reduce itself, in the reduce dtype. Adding the partial between the two
collectives is what makes the deferred result the eager one, and an identity
hook gives bitwise the gradients of no hook in every case. A hook that
reduces over process groups of its own instead of through its reducer cannot
be combined with a deferred all-reduce: its result would be all-reduced again.
``requires_all_reduce`` and the all-reduce hook are read when the reduction
is issued, so a reduction that lands later (see ``set_is_last_backward``)
keeps the settings of its backward.

[Note: Gradient hooks hold the unit weakly]
A post-accumulate-grad hook is kept alive by the autograd engine's C++ side
of the unsharded parameter, where Python's cycle collector cannot see it. A
hook that held the unit strongly (a bound method) closed a cycle unit ->
group -> unsharded parameter -> hook -> unit that ``gc`` never collects: the
whole module stayed alive after ``del model``. So the hook holds the unit by
a weak reference; the unit lives as long as its module (module -> state ->
unit), and a hook that outlives it does nothing.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shard_comms import (
    CommHandle,
    CustomAllGather,
    CustomReduceScatter,
    DefaultGradReducer,
    all_gather,
    mesh_groups,
    reduce_gradient,
)
from shard_comms.plumbing import (
    PostForwardGroup,
    comm_buffer,
    custom_all_gather,
    default_divide_factors,
    group_allocates,
)
from shard_core.protocols import CommHook, EventLike, StreamLike
from shard_runtime._comm import CommContext, streams_for
from shard_runtime._compile import eager_hook
from shard_runtime._options import MixedPrecisionPolicy
from shard_runtime._unit_layout import UnitLayout

__all__ = [
    "CommAllocator",
    "DividePlan",
    "PendingReduce",
    "ShardedState",
    "TrainingState",
    "Unit",
]

# Where a unit's collective buffers come from; see [Note: Communication controls].
CommAllocator = Literal["default", "process_group", "symm_mem"]


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


@dataclass(frozen=True, slots=True)
class DividePlan:
    """Where a reduction divides: see [Note: Communication controls].

    The gradient is divided by ``before`` ahead of the reduce-scatter, the
    reduce-scatter's result by ``after_scatter``, the replica all-reduce's by
    ``after_all_reduce``; the all-reduce hook runs next, then the result is
    divided by ``after_hook``.
    """

    before: float
    after_scatter: float
    after_all_reduce: float
    after_hook: float


def _sum_split(factor: float, reduce_dtype: torch.dtype) -> tuple[float, float]:
    """``(before, after)`` for a division by ``factor`` around a pure sum.

    fp32 and bf16 divide once, after the sum. Other dtypes (fp16; fp64 too,
    as in PyTorch) divide by a power of two before it, about the square root
    of ``factor``, so the sum neither overflows nor underflows; the split is
    PyTorch's, so fp16 gradients round as they do there.
    """
    if reduce_dtype in (torch.float32, torch.bfloat16):
        return 1.0, factor
    before = 1.0
    while factor % before == 0 and factor / before > before:
        before *= 2
    return before, factor / before


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
    group: UnitLayout
    mesh: DeviceMesh
    mp_policy: MixedPrecisionPolicy
    compute_device: torch.device
    # - state
    sharded_state: ShardedState = ShardedState.SHARDED
    training_state: TrainingState = TrainingState.IDLE
    # - per-step switches, set through the front ends
    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True
    reshard_after_backward: bool = True
    post_forward: PostForwardGroup | None = None
    # - communication in flight
    _pending_gather: _PendingGather | None = None
    _post_forward_shard: torch.Tensor | None = None  # 1D, rows * gather_numel
    _partial_reduce: torch.Tensor | None = None  # 1D, reduce-scattered but not all-reduced
    _pending_reduce: PendingReduce | None = None  # issued, not finished yet
    _grads_ready: int = 0
    _post_event: EventLike | None = None
    _materialized: bool = False  # no shard on the meta device; checked once per init_compute
    # replaces the collectives of a reduction (wrapper's register_comm_hook); see
    # [Note: Comm hooks on the one reduction path]
    comm_hook: CommHook | None = None
    on_all_grads_ready: Callable[[Unit], None] | None = None
    # - communication controls (FSDPModule.set_*); see [Note: Communication controls]
    gradient_divide_factor: float | None = None
    force_sum_reduction_for_comms: bool = False
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    all_reduce_hook_stream: StreamLike | None = None
    unshard_in_backward: bool = True
    reduce_scatter_unused_params: bool = False
    reduce_scatter_max_input_buffers: int = 1
    reduce_scatter_group: dist.ProcessGroup | None = None  # None: the shard group
    custom_all_gather: CustomAllGather | None = None
    custom_reduce_scatter: CustomReduceScatter | None = None
    comm_allocator: CommAllocator = "default"
    comm_ctx: CommContext = field(default_factory=CommContext)  # used where the unit is root

    def __post_init__(self) -> None:
        self.shard_group, self.replicate_group = mesh_groups(self.mesh)
        self.shard_world = self.shard_group.size()
        self.replicate_world = 1 if self.replicate_group is None else self.replicate_group.size()
        self.streams = streams_for(self.compute_device)
        self.init_compute()

    @property
    def comm_label(self) -> str:
        """The unit's name in profiles, logs and collective counts (``root`` for the root)."""
        return self.label or "root"

    def set_label(self, label: str) -> None:
        """Name the unit by its module's qualified name (and its parameters under it)."""
        self.label = label
        self.group.set_label(label)

    def init_compute(self) -> None:
        """(Re)build the unsharded face in the compute dtype and hook its gradients."""
        self._materialized = False  # shards may be new (``to_empty``): check them again
        # See [Note: torch.compile] in _compile.py.
        on_grad_ready = eager_hook(_weak_grad_hook(self), "post-accumulate-grad hook")
        self.group.init_compute(self.mp_policy.param_dtype, self.compute_device, on_grad_ready)

    def reset_after_apply(self) -> None:
        """Adopt new sharded tensors after ``module._apply`` (``.to()``, ``to_empty()``)."""
        self.group.reset_after_apply()
        self.init_compute()

    def _reduce_dtype(self) -> torch.dtype:
        return self.mp_policy.reduce_dtype or self.group.gather_dtype

    # ------------------------------------------------------------------ unshard

    def unshard(self, *, async_op: bool = False) -> None:
        """Start (or, with ``async_op=False``, complete) the all-gather of this unit."""
        if self.sharded_state is ShardedState.UNSHARDED or self._pending_gather is not None:
            if not async_op:
                self.wait_for_unshard()
            return
        if self.group.is_empty:
            self.sharded_state = ShardedState.UNSHARDED
            return
        if not self.unshard_in_backward and self.training_state is TrainingState.PRE_BACKWARD:
            return  # See [Note: Communication controls].
        self._check_materialized()
        # See [Note: Stream ordering] in _comm.py.
        streams = self.streams
        stream = streams.all_gather
        if self._post_event is not None:
            stream.wait_event(self._post_event)
            self._post_event = None
        else:
            stream.wait_stream(streams.current())
        with streams.handle.stream(stream):
            if self._post_forward_shard is not None:
                assert self.post_forward is not None
                send, group = self._post_forward_shard, self.post_forward.group
            else:
                send, group = self.group.gather_input(self.compute_device), self.shard_group
            output, work = self._all_gather(send, group)
            issued = stream.record_event()
        self._pending_gather = _PendingGather(work, output, send, issued)
        if not async_op:
            self.wait_for_unshard()

    def _all_gather(
        self, send: torch.Tensor, group: dist.ProcessGroup
    ) -> tuple[torch.Tensor, CommHandle]:
        """Issue the all-gather of ``send`` over ``group``: the user's, or shard's own."""
        if self.custom_all_gather is not None:
            return custom_all_gather(
                self.custom_all_gather, send, group, async_op=True, label=self.comm_label
            )
        if self._group_allocates(group):
            output = comm_buffer(
                self.shard_world * self.group.gather_numel,
                self.group.gather_dtype,
                self.compute_device,
                group,
            )
        else:
            output = self.group.gather_output(self.shard_world, self.compute_device)
        # Backward prefetches gather units that are not in PRE_BACKWARD yet: ask autograd.
        backward = torch._C._current_graph_task_id() != -1
        phase = "backward all-gather" if backward else "forward all-gather"
        return output, all_gather(
            output, send, group, async_op=True, label=self.comm_label, phase=phase
        )

    def _group_allocates(self, group: dist.ProcessGroup) -> bool:
        return self.comm_allocator != "default" and group_allocates(group, self.compute_device)

    def wait_for_unshard(self) -> None:
        """Finish a started all-gather and register the full parameters."""
        pending = self._pending_gather
        if pending is None:
            if self.sharded_state is not ShardedState.UNSHARDED and not self.group.is_empty:
                self.unshard()
            return
        self._pending_gather = None
        current = self.streams.current()
        pending.issued.wait(current)
        pending.work.wait()
        self.streams.handle.record_stream(pending.output, current)
        self.group.finish_gather(pending.output)
        self._post_forward_shard = None
        self.sharded_state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        """Register the sharded parameters again and release the full ones."""
        if self._pending_gather is not None:
            self.wait_for_unshard()
        self.group.to_sharded()
        self._post_forward_shard = None
        self.sharded_state = ShardedState.SHARDED

    def reshard_post_forward(self) -> None:
        """Reshard after forward: fully, or to the smaller post-forward group when one is set."""
        pf = self.post_forward
        if pf is None or self.sharded_state is not ShardedState.UNSHARDED or self.group.is_empty:
            self.reshard()
            return
        numel = self.group.gather_numel
        kept = torch.empty(
            pf.rows * numel, dtype=self.group.gather_dtype, device=self.compute_device
        )
        self.group.copy_gathered_rows(
            slice(pf.index * pf.rows, (pf.index + 1) * pf.rows), kept.view(pf.rows, numel)
        )
        self.reshard()
        self._post_forward_shard = kept
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    def _check_materialized(self) -> None:
        if self._materialized:
            return  # shards only move through ``_apply``, which runs ``reset_after_apply``
        on_meta = self.group.meta_fqns()
        if on_meta:
            raise RuntimeError(
                f"fully_shard({self.label or 'root'}): parameters are still on the meta device: "
                f"{', '.join(on_meta)}; call module.to_empty(device=...) and initialize them "
                "before the first forward"
            )
        self._materialized = True

    # ------------------------------------------------------------------ gradients

    def sync_requires_grad(self) -> None:
        """Train the parameters whose ``requires_grad`` is set now, from this forward on.

        A reduction of this unit still in flight was laid out for the old set
        of parameters, so it lands first. See [Note: requires_grad is read at
        every forward] in ``_per_param_layout.py``.
        """
        if not self.group.requires_grad_changed():
            return
        if self._pending_reduce is not None:
            self._pending_reduce.finish()
        if self._partial_reduce is not None:
            raise RuntimeError(
                f"fully_shard({self.comm_label}): requires_grad of a parameter of "
                f"{', '.join(self.group.fqns)} changed while its gradients wait for the replica "
                "all-reduce (set_requires_all_reduce(False)); change requires_grad after a "
                "backward with set_requires_all_reduce(True)"
            )
        self.group.sync_requires_grad()

    def _on_grad_ready(self, _param: torch.Tensor) -> None:
        self._grads_ready += 1
        if self._grads_ready == self.group.num_trainable and self.on_all_grads_ready is not None:
            self.on_all_grads_ready(self)

    def grads_ready(self) -> bool:
        """Whether every trainable parameter got its gradient in this backward."""
        return self._grads_ready >= self.group.num_trainable

    def reset_backward(self) -> None:
        """Forget this backward's gradient bookkeeping."""
        self._grads_ready = 0

    def has_unsharded_grads(self) -> bool:
        """Whether any full gradient waits to be reduced."""
        return self.group.has_unsharded_grads()

    def divide_plan(self, reduce_dtype: torch.dtype) -> DividePlan:
        """Where this unit's next reduction divides; see [Note: Communication controls]."""
        dp_size = self.shard_world * self.replicate_world
        hsdp = self.replicate_group is not None
        factor = self.gradient_divide_factor
        narrow = reduce_dtype not in (torch.float32, torch.bfloat16)
        # Narrow dtypes split around a pure sum in PyTorch whatever the flags; shard keeps its
        # own split (see [Note: Divide factors]) unless a factor or a hook makes it visible.
        visible = factor is not None or self.all_reduce_hook is not None
        if self.force_sum_reduction_for_comms or (narrow and visible):
            before, after = _sum_split(float(dp_size) if factor is None else factor, reduce_dtype)
            return DividePlan(before, 1.0, 1.0, after)
        if factor is not None:  # one division of the full sum, before the hook
            return DividePlan(1.0, 1.0 if hsdp else factor, factor if hsdp else 1.0, 1.0)
        pre, post = default_divide_factors(dp_size)
        return DividePlan(pre, 1.0 if hsdp else post, post if hsdp else 1.0, 1.0)

    def grad_reducer(self, plan: DividePlan, *, replicas: bool = True) -> DefaultGradReducer:
        """This unit's reducer for a reduction divided by ``plan``.

        Its group (``reduce_scatter_group``, else the shard group), replicate
        group, divide factors and custom reduce-scatter are the unit's; the
        default path and a comm hook use the same one (see [Note: Comm hooks
        on the one reduction path]). ``replicas=False`` leaves the replicate
        group out: the reducer then stops after the reduce-scatter.
        """
        replicate = self.replicate_group if replicas else None
        # On a 1-D mesh ``after_all_reduce`` is 1; on a 2-D one ``after_scatter`` is.
        post = plan.after_scatter * (plan.after_all_reduce if replicate is not None else 1.0)
        return DefaultGradReducer(
            self.reduce_scatter_group or self.shard_group,
            replicate_group=replicate,
            op="sum",
            pre_divide=plan.before,
            post_divide=post,
            custom_reduce_scatter=self.custom_reduce_scatter,
            label=self.comm_label,
        )

    def reduce_grads(self) -> PendingReduce | None:
        """Issue the reduction of this unit's full gradients; ``None`` if there are none.

        The result is averaged over every data-parallel rank (shard x
        replicate) unless the unit's communication controls say otherwise (see
        [Note: Communication controls]). With ``reduce_scatter_unused_params``
        a unit that got no gradient reduces zeros. A ``comm_hook`` replaces
        the reduce-scatter (and the replica all-reduce when it can run at
        once); everything else is the same code (see [Note: Comm hooks on the
        one reduction path]).
        """
        if self.group.num_trainable == 0 or not (
            self.group.has_unsharded_grads() or self.reduce_scatter_unused_params
        ):
            return None
        if self._pending_reduce is not None:
            # See [Note: a backward that is not the last] in _state.py.
            self._pending_reduce.finish()
        reduce_dtype = self._reduce_dtype()
        plan = self.divide_plan(reduce_dtype)
        hook = self.comm_hook
        all_reduce_now = self.requires_all_reduce
        # See [Note: Comm hooks on the one reduction path].
        hook_replicates = (
            hook is not None
            and self.replicate_group is not None
            and all_reduce_now
            and self._partial_reduce is None
        )
        reducer = self.grad_reducer(plan)
        group = reducer.group
        assert group is not None
        # See [Note: Stream ordering] in _comm.py.
        streams = self.streams
        stream = streams.reduce_scatter
        stream.wait_stream(streams.current())
        with streams.handle.stream(stream):
            full = self.group.reduce_input(self.shard_world, reduce_dtype, self.compute_device)
            into: torch.Tensor | None = None  # a custom reduce-scatter allocates its own
            if self.custom_reduce_scatter is None and self._group_allocates(group):
                staged = comm_buffer(full.numel(), reduce_dtype, self.compute_device, group)
                full = staged.copy_(full)
                into = comm_buffer(
                    self.group.reduce_numel(), reduce_dtype, self.compute_device, group
                )
            elif self.custom_reduce_scatter is None or hook is not None:
                into = torch.empty(
                    self.group.reduce_numel(), dtype=reduce_dtype, device=self.compute_device
                )
            if hook is None:
                output, work = reducer.scatter(full, into, async_op=True)
            else:
                assert into is not None
                hook_reducer = (
                    reducer if hook_replicates else self.grad_reducer(plan, replicas=False)
                )
                reduce_gradient(full, into, hook_reducer, hook)
                output, work = into, CommHandle(None, None)
            done = stream.record_event()
        all_reduce_hook = self.all_reduce_hook

        def finish() -> None:
            if self._pending_reduce is pending:
                self._pending_reduce = None
            done.wait(streams.current())
            if self.replicate_group is not None and not hook_replicates:
                if self._partial_reduce is not None:
                    output.add_(self._partial_reduce)
                    self._partial_reduce = None
                if not all_reduce_now:
                    self._partial_reduce = output
                    return
                reducer.all_reduce_replicas(output)
            if all_reduce_hook is not None:
                self._run_all_reduce_hook(all_reduce_hook, output)
            if plan.after_hook != 1.0:
                output.div_(plan.after_hook)
            self.group.accumulate(output)

        pending = PendingReduce(work, finish, keep_alive=(full,))
        self._pending_reduce = pending
        return pending

    def _run_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], output: torch.Tensor
    ) -> None:
        """Call ``hook`` on the reduced shard, on the user's stream when one was given."""
        hook_stream = self.all_reduce_hook_stream
        if hook_stream is None:
            hook(output)
            return
        streams = self.streams
        hook_stream.wait_stream(streams.current())
        with streams.handle.stream(hook_stream):
            hook(output)
        streams.current().wait_stream(hook_stream)


def _weak_grad_hook(unit: Unit) -> Callable[[torch.Tensor], None]:
    """``unit._on_grad_ready``, holding the unit weakly.

    See [Note: Gradient hooks hold the unit weakly].
    """
    ref = weakref.ref(unit)

    def on_grad_ready(param: torch.Tensor) -> None:
        live = ref()
        if live is not None:
            live._on_grad_ready(param)

    return on_grad_ready
