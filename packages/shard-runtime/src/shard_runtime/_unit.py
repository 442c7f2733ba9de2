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
  and one after the sum (see [Note: Divide factors] in shard-comms), on a
  2-D mesh once or per collective (see [Note: Averaging per collective]).
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
- ``unshard_async_op`` (``FSDPModule._set_unshard_async_op``) issues the
  unit's all-gathers (and their copy-in) on the compute stream instead of the
  all-gather stream, as PyTorch does for an ``async_op`` unshard: the
  buffers are then allocated on the compute stream, which avoids memory
  fragmentation between streams; overlap then needs explicit prefetching
  (``unshard(async_op=True)``, ``set_modules_to_forward_prefetch``), since
  the gather no longer runs beside the compute. Values and collectives are
  the same;
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
  allocator where its backend has one (``"process_group"``, ``"symm_mem"``);
- ``weight_codec`` / ``grad_codec`` (``set_comm_codec``) encode what the
  all-gathers and the gradient reductions send (see [Note: Comm codecs]).

[Note: Averaging per collective]
On a 2-D (replicate, shard) mesh the average over every data-parallel rank
can be taken once or in two steps, and in floating point the two round
differently when a group's size is not a power of two. PyTorch's FSDP2
averages inside each collective for float32 and bfloat16 gradients: the
reduce-scatter's result is divided by the shard group's size and the
replica all-reduce's by the number of replicas, so with the all-reduce
deferred (``set_requires_all_reduce(False)``) every micro-batch's partial
is an average before the partials are added. FSDP1's HYBRID_SHARD divides
once over the whole data-parallel size, split around the sum (see [Note:
Divide factors] in shard-comms). Each front end asks for its own
(``FrontEndRules.average_per_collective``); narrower reduce dtypes and
the communication controls that move the division keep one split in both,
as in PyTorch. Both ways are the same average: only the last bit differs.

[Note: Comm codecs]
A comm codec (``shard_core.protocols.CommCodec``, from a plugin such as
shard-comm-quant's ``"int8"``) changes what crosses the wire and nothing
else. With ``weight_codec`` the unit's all-gather over its shard group sends
each rank's shard encoded and every rank decodes every row, its own
included, so all ranks compute with the same full parameters; the sharded
parameters, the optimizer's state, state dicts, ``summon_full_params`` and
checkpoints keep full precision (``summon_full_params`` gathers without
the codec). The all-gather of a post-forward group
(``reshard_after_forward=int``) resends the already decoded values in their
own dtype, so backward sees exactly the forward's parameters. With
``grad_codec`` the reduce-scatter (and on a 2-D mesh the replica
all-reduce) sends encoded gradient rows, sums them in float32 and divides
as the plain path does; with ``error_feedback`` each path keeps what its
encodings lost (``ErrorFeedback``, one per gradient bucket, float32: the
rows this rank sends, ``(N - 1) / N`` of the unit's full gradient over N
shard ranks, plus a shard's worth across replicas; see ``feedback_nbytes``,
and ``shard plan --comm-quant``, which counts them) and adds it to the next
step's gradient. A dtype no codec takes (the bytes of a
mixed-dtype unit, float8) communicates plainly. Both are exclusive with the
object that would replace the same collective: a custom all-gather, a
custom reduce-scatter or a comm hook (refused where they are set).

[Note: Comm hooks on the one reduction path]
A comm hook (the wrapper's ``register_comm_hook``) changes one step of the
unit's reduction, the collectives, and nothing else: :meth:`Unit.reduce_grads`
builds the same reducer (:meth:`Unit.grad_reducer`: the unit's groups,
``reduce_scatter_group`` included, its divide plan, its custom reduce-scatter)
and allocates the same buffers on the reduce-scatter stream, then calls either
``reducer.scatter`` (asynchronous) or the hook through ``reduce_gradient``
(synchronous: a hook's result is final when it returns). One landing follows
for both (:meth:`~shard_runtime._reduction.IssuedReduction.land`): the
deferred replica all-reduce, the all-reduce hook, the division after it, the
accumulation.

On a 2-D mesh the hook is handed the whole reduction (reduce-scatter, then
the replica all-reduce, which a compressing hook then compresses too) only
when that all-reduce runs now with nothing deferred before it. Otherwise,
while ``requires_all_reduce`` is ``False`` and in the first reduction after a
deferral, its reducer has no replicate group: the hook reduce-scatters, and
the landing adds the kept partial and runs (or defers again) the replica
all-reduce itself, in the reduce dtype. Adding the partial between the two
collectives is what makes the deferred result the eager one, and an identity
hook gives bitwise the gradients of no hook in every case. A hook that
reduces over process groups of its own instead of through its reducer cannot
be combined with a deferred all-reduce: its result would be all-reduced again.
``requires_all_reduce`` and the all-reduce hook are read when the reduction
is issued, so a reduction that lands later (see ``set_is_last_backward``)
keeps the settings of its backward.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shard_comms import (
    CommHandle,
    CustomAllGather,
    CustomReduceScatter,
    DefaultGradReducer,
    ErrorFeedback,
    all_gather,
    mesh_groups,
    reduce_gradient,
)
from shard_comms.plumbing import (
    ENCODABLE_DTYPES,
    PostForwardGroup,
    comm_buffer,
    custom_all_gather,
    divide_factors,
    encoded_all_gather,
    group_allocates,
)
from shard_core.protocols import CommCodec, CommHook, EventLike, StreamLike
from shard_runtime._comm import CommContext, streams_for
from shard_runtime._optimizer_steps import optimizer_steps
from shard_runtime._options import MixedPrecisionPolicy
from shard_runtime._reduction import IssuedReduction, Reductions
from shard_runtime._unit_layout import GradPresence, UnitLayout

__all__ = [
    "CommAllocator",
    "DividePlan",
    "ReshardAfterForward",
    "ShardedState",
    "TrainingState",
    "Unit",
    "raise_on_meta",
]

# Where a unit's collective buffers come from; see [Note: Communication controls].
CommAllocator = Literal["default", "process_group", "symm_mem"]

# Where a unit's parameters go after forward: ``True``: back to the shards; ``False``: kept
# full for backward; a :class:`PostForwardGroup`: to a shard over that smaller group
# (``reshard_after_forward=int``), so backward gathers within it; ``None``: not decided yet
# (``fully_shard``'s default, resolved at lazy init: see [Note: the root] in _state.py).
ReshardAfterForward = bool | PostForwardGroup | None


def raise_on_meta(api: str, fqns: list[str]) -> None:
    """Raise the error for parameters still on the meta device at the first forward."""
    raise RuntimeError(
        f"{api}: parameters are still on the meta device: {', '.join(fqns)}; call "
        "module.to_empty(device=...) and initialize them before the first forward"
    )


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


@dataclass(slots=True)
class _PendingGather:
    work: CommHandle
    output: torch.Tensor  # 1D, world * per_rank
    send: torch.Tensor  # 1D, per_rank: the input, held until the collective completes
    issued: EventLike  # end of the copy-in and the collective call on the all-gather stream


class _KeptFrom(NamedTuple):
    """What a copy kept unsharded was gathered from: see [Note: a kept unsharded copy is
    checked before reuse]."""

    optimizer_steps: int  # the process's count when the copy was kept
    shards: tuple[int, ...]  # the layout's source_versions()
    faces: tuple[int, ...]  # the layout's face_versions()


@dataclass(eq=False)
class Unit:
    """The engine's communication group; see the module docstring."""

    label: str
    layout: UnitLayout
    mesh: DeviceMesh
    mp_policy: MixedPrecisionPolicy
    compute_device: torch.device
    api: str  # the front end's name, starting error messages
    # FrontEndRules.average_per_collective; see [Note: Averaging per collective]
    average_per_collective: bool = True
    # - state
    sharded_state: ShardedState = ShardedState.SHARDED
    training_state: TrainingState = TrainingState.IDLE
    # - per-step switches, set through the front ends
    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True
    reshard_after_forward: ReshardAfterForward = True
    reshard_after_backward: bool = True
    # - communication in flight
    _pending_gather: _PendingGather | None = None
    _post_forward_shard: torch.Tensor | None = None  # 1D, rows * gather_numel
    _post_optim_event: EventLike | None = None  # the next all-gather waits for it
    # what a copy kept unsharded was gathered from; see [Note: a kept unsharded copy is
    # checked before reuse]
    _kept_from: _KeptFrom | None = None
    # what an all-gather started without waiting (a prefetch) gathers: the same note
    _gathering_from: _KeptFrom | None = None
    _materialized: bool = False  # no shard on the meta device; checked once per init_compute
    # called once per trainable leaf whose gradient autograd accumulated (the state's hook)
    _on_grad_ready: Callable[[torch.Tensor], None] | None = None
    # replaces the collectives of a reduction (wrapper's register_comm_hook); see
    # [Note: Comm hooks on the one reduction path]
    comm_hook: CommHook | None = None
    # - communication controls (FSDPModule.set_*); see [Note: Communication controls]
    gradient_divide_factor: float | None = None
    force_sum_reduction_for_comms: bool = False
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    all_reduce_hook_stream: StreamLike | None = None
    unshard_in_backward: bool = True
    unshard_async_op: bool = False
    reduce_scatter_unused_params: bool = False
    reduce_scatter_max_input_buffers: int = 1
    reduce_scatter_group: dist.ProcessGroup | None = None  # None: the shard group
    custom_all_gather: CustomAllGather | None = None
    custom_reduce_scatter: CustomReduceScatter | None = None
    comm_allocator: CommAllocator = "default"
    comm_ctx: CommContext = field(default_factory=CommContext)  # used where the unit is root
    # - comm codecs (set_comm_codec); see [Note: Comm codecs]
    weight_codec: CommCodec | None = None
    grad_codec: CommCodec | None = None
    error_feedback: bool = True
    _feedback: dict[int, ErrorFeedback] = field(default_factory=dict)  # by gradient bucket

    def __post_init__(self) -> None:
        self.shard_group, self.replicate_group = mesh_groups(self.mesh)
        self.shard_world = self.shard_group.size()
        self.shard_rank = self.shard_group.rank()
        self.replicate_world = 1 if self.replicate_group is None else self.replicate_group.size()
        self.streams = streams_for(self.compute_device)
        # What the unit has issued and not accumulated yet; see _reduction.py.
        self.reductions = Reductions(self.layout, self.streams)

    @property
    def comm_label(self) -> str:
        """The unit's name in profiles, logs and collective counts (``root`` for the root)."""
        return self.label or "root"

    @property
    def gather_in_flight(self) -> bool:
        """Whether an all-gather was started and not waited for (a prefetch)."""
        return self._pending_gather is not None

    def set_label(self, label: str) -> None:
        """Name the unit by its module's qualified name (and its parameters under it)."""
        self.label = label
        self.layout.set_label(label)

    def check_comm_codecs(
        self, weights: CommCodec | None, grads: CommCodec | None, *, api: str
    ) -> None:
        """Refuse codecs that would replace a collective something else already replaces.

        Raises:
            ValueError: a custom all-gather (with ``weights``), or a custom
                reduce-scatter or comm hook (with ``grads``), is set on the unit.
        """
        clashes = [
            ("weights", weights, self.custom_all_gather, "a custom all-gather"),
            ("grads", grads, self.custom_reduce_scatter, "a custom reduce-scatter"),
            ("grads", grads, self.comm_hook, "a comm hook"),
        ]
        for side, codec, other, what in clashes:
            if codec is not None and other is not None:
                raise ValueError(
                    f"{api}({self.comm_label}): {side}={codec!r} cannot be combined with "
                    f"{what} ({other!r}) on this unit: both replace the same collective; set "
                    "one of them"
                )

    def check_no_codec(self, side: str, what: str, api: str) -> None:
        """Refuse ``what`` (a custom collective, a comm hook) where a codec encodes ``side``.

        Raises:
            ValueError: ``set_comm_codec`` set a codec for ``side`` on this unit.
        """
        codec = self.weight_codec if side == "weights" else self.grad_codec
        if codec is not None:
            raise ValueError(
                f"{api}({self.comm_label}): this unit encodes its {side} with {codec!r} "
                f"(set_comm_codec); {what} would replace the same collective: call "
                f"set_comm_codec({side}=None) first, or keep the codec"
            )

    def set_comm_codecs(
        self,
        weights: CommCodec | None,
        grads: CommCodec | None,
        *,
        error_feedback: bool,
        api: str,
    ) -> None:
        """Encode this unit's all-gathers and/or reductions; see [Note: Comm codecs].

        Lands reductions in flight (issued with the old codec) and forgets the
        error feedback kept so far. ``api`` starts error messages.

        Raises:
            ValueError: see :meth:`check_comm_codecs`.
        """
        self.check_comm_codecs(weights, grads, api=api)
        self.reductions.land()
        self.weight_codec = weights
        self.grad_codec = grads
        self.error_feedback = error_feedback
        self._feedback.clear()

    @property
    def feedback_nbytes(self) -> int:
        """Bytes of error-feedback residuals this unit keeps between steps."""
        return sum(feedback.nbytes for feedback in self._feedback.values())

    def wait_before_next_gather(self, event: EventLike) -> None:
        """Make the next all-gather wait for ``event`` (``set_post_optim_event``)."""
        self._post_optim_event = event

    def hook_gradients(self, on_grad_ready: Callable[[torch.Tensor], None]) -> None:
        """Call ``on_grad_ready`` for every trainable leaf's gradient, from now on."""
        self._on_grad_ready = on_grad_ready
        self.init_compute()

    def init_compute(self) -> None:
        """(Re)build the unsharded face in the compute dtype and hook its gradients."""
        assert self._on_grad_ready is not None, "hook_gradients comes first"
        self._materialized = False  # shards may be new (``to_empty``): check them again
        self.layout.init_compute(
            self.mp_policy.param_dtype, self.compute_device, self._on_grad_ready
        )

    def reset_after_apply(self) -> None:
        """Adopt new sharded tensors after ``module._apply`` (``.to()``, ``to_empty()``)."""
        self.layout.reset_after_apply()
        self.init_compute()

    # ------------------------------------------------------------------ unshard

    # [Note: a kept unsharded copy is checked before reuse]
    # A unit left unsharded after a forward (the root; reshard_after_forward=False;
    # SHARD_GRAD_OP, NO_SHARD) or a backward (reshard_after_backward=False) computes its next
    # forward with the copy it holds (with an int reshard_after_forward, gathers it from the
    # post-forward group's rows it kept). That copy is stale if its shards were written in
    # between: an optimizer step after a validation forward, weights swapped in for an
    # evaluation and restored, load_state_dict, any in-place edit of the parameters.
    # PyTorch's FSDP1 and FSDP2 reuse it anyway, so the write is silently lost (the forward
    # sees the old values, the backward's gradients belong to them). shard remembers, when
    # it keeps a copy, the process's optimizer step count and the version counters of the
    # shards and of the parameters over them, and reshards the unit before the next forward
    # if any moved, so that forward gathers again. Where the unsharded parameters themselves
    # are registered meanwhile (fully_shard's kept units, as FSDP2), a write made to them is
    # carried into each rank's own rows of the shard first (FSDP2 drops it at the next
    # reshard). A copy nobody wrote costs one read of each counter.
    #
    # Every rank must decide alike, or their collectives stop matching. An optimizer step is
    # counted, not read from version counters, for that reason (see _optimizer_steps.py);
    # other writes are seen alike where every rank makes them, as code that writes every
    # parameter does (a write to an empty tensor counts too). Writes through ``.data`` move
    # no counter and stay unseen, as in PyTorch.
    #
    # A prefetch (an all-gather started and not waited for) is a copy too: one left in flight
    # past a write (issued after a backward's last unit was done, or for a unit the forward
    # never reached) would serve the next forward the values from before the write. Its
    # sources are remembered when it is issued, and checked the same way.

    def keep_unsharded(self) -> None:
        """The unit stays unsharded after its forward or backward, or keeps its post-forward
        group's rows: remember its sources."""
        if self.sharded_state is not ShardedState.SHARDED:
            self._kept_from = _KeptFrom(
                optimizer_steps(), self.layout.source_versions(), self.layout.face_versions()
            )

    def drop_stale_copy(self) -> None:
        """Before a forward: reshard a kept copy written since it was kept, carrying writes
        made to the unsharded parameters into the shards."""
        gathering, self._gathering_from = self._gathering_from, None
        if gathering is not None and self.gather_in_flight and self._moved(gathering):
            self.reshard()  # waits for the gather and drops it; the forward gathers again
            return
        kept, self._kept_from = self._kept_from, None
        if kept is None or self.sharded_state is ShardedState.SHARDED:
            return
        moved = self._moved(kept)
        if not moved and self.sharded_state is ShardedState.UNSHARDED:
            # Carried into the shards, writes to the unsharded parameters make the copy stale.
            moved = self.layout.write_back_faces(kept.faces)
        if moved:
            # The copy, or the post-forward group's rows, no longer match the shards.
            self.reshard()

    def _moved(self, copied: _KeptFrom) -> bool:
        """Whether the shards were written since ``copied`` was taken from them."""
        return copied.optimizer_steps != optimizer_steps() or (
            copied.shards != self.layout.source_versions()
        )

    def unshard(self, *, async_op: bool = False) -> None:
        """Start (or, with ``async_op=False``, complete) the all-gather of this unit."""
        if self.sharded_state is ShardedState.UNSHARDED or self._pending_gather is not None:
            if not async_op:
                self.wait_for_unshard()
            return
        if self.layout.is_empty:
            self.sharded_state = ShardedState.UNSHARDED
            return
        if not self.unshard_in_backward and self.training_state is TrainingState.PRE_BACKWARD:
            return  # See [Note: Communication controls].
        self._check_materialized()
        # See [Note: Stream ordering] in _comm.py, and [Note: Communication controls] for
        # ``unshard_async_op``.
        streams = self.streams
        stream = streams.current() if self.unshard_async_op else streams.all_gather
        if self._post_optim_event is not None:
            stream.wait_event(self._post_optim_event)
            self._post_optim_event = None
        elif not self.unshard_async_op:
            stream.wait_stream(streams.current())
        with streams.handle.stream(stream):
            if self._post_forward_shard is not None:
                assert isinstance(self.reshard_after_forward, PostForwardGroup)
                send, group = self._post_forward_shard, self.reshard_after_forward.group
                output, work = self._all_gather(send, group)
            else:
                output, send, work = self._gather_shards()
            issued = stream.record_event()
        self._pending_gather = _PendingGather(work, output, send, issued)
        if async_op:  # See [Note: a kept unsharded copy is checked before reuse].
            self._gathering_from = _KeptFrom(optimizer_steps(), self.layout.source_versions(), ())
        else:
            self.wait_for_unshard()

    def _gather_shards(self) -> tuple[torch.Tensor, torch.Tensor, CommHandle]:
        """Issue the all-gather of the unit's shards; its output, input and handle.

        shard's own all-gather runs in place where the layout can write this
        rank's input into its row of the output (see [Note: the all-gather
        input is a row of its output] in ``_per_param_layout.py``).
        """
        group = self.shard_group
        # A comm codec encodes the whole input before it writes the output: not in place.
        in_place = self.custom_all_gather is None and self.weight_codec is None
        if in_place and not self._group_allocates(group):
            staged = self.layout.gather_input_in_output(
                self.shard_world, self.shard_rank, self.compute_device
            )
            if staged is not None:
                output, send = staged
                phase = self._gather_phase()
                return output, send, self._issue_all_gather(output, send, group, phase)
        send = self.layout.gather_input(self.compute_device)
        output, work = self._all_gather(send, group)
        return output, send, work

    def _all_gather(
        self, send: torch.Tensor, group: dist.ProcessGroup
    ) -> tuple[torch.Tensor, CommHandle]:
        """Issue the all-gather of ``send`` over ``group``: the user's, or shard's own."""
        if self.custom_all_gather is not None:
            return custom_all_gather(
                self.custom_all_gather, send, group, async_op=True, label=self.comm_label
            )
        phase = self._gather_phase()
        codec = self.weight_codec
        if codec is not None and group is self.shard_group and send.dtype in ENCODABLE_DTYPES:
            # See [Note: Comm codecs].
            output = self.layout.gather_output(self.shard_world, self.compute_device)
            return output, encoded_all_gather(
                codec, output, send, group, async_op=True, label=self.comm_label, phase=phase
            )
        if self._group_allocates(group):
            output = comm_buffer(
                self.shard_world * self.layout.gather_numel,
                self.layout.gather_dtype,
                self.compute_device,
                group,
            )
        else:
            output = self.layout.gather_output(self.shard_world, self.compute_device)
        return output, self._issue_all_gather(output, send, group, phase)

    def _issue_all_gather(
        self, output: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup, phase: str
    ) -> CommHandle:
        return all_gather(output, send, group, async_op=True, label=self.comm_label, phase=phase)

    @staticmethod
    def _gather_phase() -> str:
        # Backward prefetches gather units that are not in PRE_BACKWARD yet: ask autograd.
        backward = torch._C._current_graph_task_id() != -1
        return "backward all-gather" if backward else "forward all-gather"

    def _group_allocates(self, group: dist.ProcessGroup) -> bool:
        return self.comm_allocator != "default" and group_allocates(group, self.compute_device)

    def wait_for_unshard(self) -> None:
        """Finish a started all-gather and register the full parameters."""
        pending = self._pending_gather
        if pending is None:
            if self.sharded_state is not ShardedState.UNSHARDED and not self.layout.is_empty:
                self.unshard()
            return
        self._pending_gather = None
        current = self.streams.current()
        pending.issued.wait(current)
        pending.work.wait()
        self.streams.handle.record_stream(pending.output, current)
        self.layout.finish_gather(pending.output)
        self._post_forward_shard = None
        self.sharded_state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        """Register the sharded parameters again and release the full ones."""
        if self._pending_gather is not None:
            self.wait_for_unshard()
        self.layout.to_sharded()
        self._post_forward_shard = None
        self._kept_from = self._gathering_from = None
        self.sharded_state = ShardedState.SHARDED

    def reshard_post_forward(self) -> None:
        """Reshard after forward: fully, or to the smaller post-forward group when one is set."""
        pf = self.reshard_after_forward
        if (
            not isinstance(pf, PostForwardGroup)
            or self.sharded_state is not ShardedState.UNSHARDED
            or self.layout.is_empty
        ):
            self.reshard()
            return
        numel = self.layout.gather_numel
        kept = torch.empty(
            pf.rows * numel, dtype=self.layout.gather_dtype, device=self.compute_device
        )
        self.layout.copy_gathered_rows(
            slice(pf.index * pf.rows, (pf.index + 1) * pf.rows), kept.view(pf.rows, numel)
        )
        self.reshard()
        self._post_forward_shard = kept
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD
        self.keep_unsharded()

    def _check_materialized(self) -> None:
        if self._materialized:
            return  # shards only move through ``_apply``, which runs ``reset_after_apply``
        on_meta = self.layout.meta_fqns()
        if on_meta:
            raise_on_meta(f"{self.api}({self.comm_label})", on_meta)
        self._materialized = True

    # ------------------------------------------------------------------ gradients

    def sync_requires_grad(self) -> None:
        """Train the parameters whose ``requires_grad`` is set now, from this forward on.

        A reduction of this unit still in flight was laid out for the old set
        of parameters, so it lands first. See [Note: requires_grad is read at
        every forward] in ``_per_param_layout.py``.
        """
        if not self.layout.requires_grad_changed():
            return
        self.reductions.land()
        if self.reductions.partials:
            raise RuntimeError(
                f"{self.api}({self.comm_label}): requires_grad of a parameter of "
                f"{', '.join(self.layout.fqns)} changed while its gradients wait for the replica "
                "all-reduce (set_requires_all_reduce(False)); change requires_grad after a "
                "backward with set_requires_all_reduce(True)"
            )
        self.layout.sync_requires_grad()

    def has_unsharded_grads(self) -> bool:
        """Whether any full gradient waits to be reduced."""
        return self.layout.has_unsharded_grads()

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
            # fp32 and bf16 divide once, after the sum; narrower dtypes split the division
            # around it (see [Note: Divide factors] in shard-comms).
            total = float(dp_size) if factor is None else factor
            before, after = (1.0, total) if not narrow else divide_factors(total)
            return DividePlan(before, 1.0, 1.0, after)
        if factor is not None:  # one division of the full sum, before the hook
            return DividePlan(1.0, 1.0 if hsdp else factor, factor if hsdp else 1.0, 1.0)
        if hsdp and self.average_per_collective and not narrow:
            # See [Note: Averaging per collective].
            pre, post = divide_factors(self.shard_world)
            return DividePlan(pre, post, float(self.replicate_world), 1.0)
        pre, post = divide_factors(dp_size)
        return DividePlan(pre, 1.0 if hsdp else post, post if hsdp else 1.0, 1.0)

    def grad_reducer(
        self,
        plan: DividePlan,
        *,
        replicas: bool = True,
        reduce_dtype: torch.dtype | None = None,
        bucket: int = 0,
    ) -> DefaultGradReducer:
        """This unit's reducer for a reduction divided by ``plan``.

        Its group (``reduce_scatter_group``, else the shard group), replicate
        group, divide factors and custom reduce-scatter are the unit's; the
        default path and a comm hook use the same one (see [Note: Comm hooks
        on the one reduction path]). ``replicas=False`` leaves the replicate
        group out: the reducer then stops after the reduce-scatter. With a
        ``grad_codec`` that takes ``reduce_dtype``, the reducer sends encoded
        rows, keeping ``bucket``'s error feedback (see [Note: Comm codecs]).
        """
        codec = self.grad_codec
        if codec is not None and reduce_dtype not in ENCODABLE_DTYPES:
            codec = None
        feedback = None
        if codec is not None and self.error_feedback:
            feedback = self._feedback.setdefault(bucket, ErrorFeedback())
        replicate = self.replicate_group if replicas else None
        return DefaultGradReducer(
            self.reduce_scatter_group or self.shard_group,
            replicate_group=replicate,
            op="sum",
            pre_divide=plan.before,
            post_divide=plan.after_scatter,
            custom_reduce_scatter=self.custom_reduce_scatter,
            label=self.comm_label,
            codec=codec,
            feedback=feedback,
            replicas_post_divide=None if replicate is None else plan.after_all_reduce,
        )

    def reduce_grads(self) -> list[IssuedReduction]:
        """Issue the reductions of this unit's full gradients; none if there are none.

        Step 3 of [Note: the path of one gradient] in ``_reduction.py``. One
        reduction per gradient bucket (one, unless the trainable parameters
        mix dtypes: see [Note: one reduction per gradient dtype] in
        ``_per_param_layout.py``). The result is averaged over every
        data-parallel rank (shard x replicate) unless the unit's communication
        controls say otherwise (see [Note: Communication controls]). With
        ``reduce_scatter_unused_params`` a unit that got no gradient reduces
        zeros. A ``comm_hook`` replaces the reduce-scatter (and the replica
        all-reduce when it can run at once); everything else is the same code
        (see [Note: Comm hooks on the one reduction path]).
        """
        if self.layout.num_trainable == 0 or not (
            self.layout.has_unsharded_grads() or self.reduce_scatter_unused_params
        ):
            return []
        # One unit's reductions land in the order issued; see [Note: a backward that is not
        # the last] in _state.py.
        self.reductions.land()
        issued = [
            self._reduce_bucket(bucket, self.mp_policy.reduce_dtype or grad_dtype)
            for bucket, grad_dtype in enumerate(self.layout.grad_dtypes)
        ]
        self.reductions.issued = list(issued)
        return issued

    def _reduce_bucket(self, bucket: int, reduce_dtype: torch.dtype) -> IssuedReduction:
        plan = self.divide_plan(reduce_dtype)
        # See [Note: Comm hooks on the one reduction path].
        hook_replicates = (
            self.comm_hook is not None
            and self.replicate_group is not None
            and self.requires_all_reduce
            and bucket not in self.reductions.partials
        )
        reducer = self.grad_reducer(plan, reduce_dtype=reduce_dtype, bucket=bucket)
        hook_reducer = (
            None
            if self.comm_hook is None
            else reducer
            if hook_replicates
            else self.grad_reducer(plan, replicas=False)
        )
        work, output, event, presence, full = self._start_reduction(
            reducer, hook_reducer, reduce_dtype, bucket
        )
        return IssuedReduction(
            owner=self.reductions,
            bucket=bucket,
            work=work,
            output=output,
            issued=event,
            presence=presence,
            replicas=reducer if self.replicate_group is not None and not hook_replicates else None,
            all_reduce_now=self.requires_all_reduce,
            zero_unused=self.reduce_scatter_unused_params,
            all_reduce_hook=self.all_reduce_hook,
            all_reduce_hook_stream=self.all_reduce_hook_stream,
            after_hook=plan.after_hook,
            keep_alive=(full,),
        )

    def _start_reduction(
        self,
        reducer: DefaultGradReducer,
        hook_reducer: DefaultGradReducer | None,
        reduce_dtype: torch.dtype,
        bucket: int,
    ) -> tuple[CommHandle, torch.Tensor, EventLike, GradPresence, torch.Tensor]:
        """Copy the gradients in and start the collective on the reduce-scatter stream.

        ``reducer`` runs the default path; ``hook_reducer`` is what the comm
        hook, if there is one, is handed. Returns the collective's handle, its
        output, the event that ends it on the stream, which parameters had a
        gradient, and the input (held until the collective completes).
        """
        group = reducer.group
        assert group is not None
        hook = self.comm_hook
        # See [Note: Stream ordering] in _comm.py.
        streams = self.streams
        stream = streams.reduce_scatter
        stream.wait_stream(streams.current())
        with streams.handle.stream(stream):
            full, presence = self.layout.reduce_input(
                self.shard_world, reduce_dtype, self.compute_device, bucket
            )
            into: torch.Tensor | None = None  # a custom reduce-scatter allocates its own
            if (
                reducer.codec is None
                and self.custom_reduce_scatter is None
                and (self._group_allocates(group))
            ):
                staged = comm_buffer(full.numel(), reduce_dtype, self.compute_device, group)
                full = staged.copy_(full)
                into = comm_buffer(
                    self.layout.reduce_numel(bucket), reduce_dtype, self.compute_device, group
                )
            elif self.custom_reduce_scatter is None or hook is not None:
                into = torch.empty(
                    self.layout.reduce_numel(bucket),
                    dtype=reduce_dtype,
                    device=self.compute_device,
                )
            if hook is None:
                output, work = reducer.scatter(full, into, async_op=True)
            else:
                assert into is not None
                assert hook_reducer is not None
                reduce_gradient(full, into, hook_reducer, hook, unit=self.comm_label)
                output, work = into, CommHandle(None, None)
            event = stream.record_event()
        return work, output, event, presence, full
