"""A unit's gradient reductions between being issued and landing in the sharded gradients.

Each unit has one :class:`Reductions`: the reductions it has issued and not
landed yet (those of one backward: one per gradient dtype, see [Note: one
reduction per gradient dtype] in ``_per_param_layout.py``; a unit lands its
previous ones before issuing the next), and the partial results a deferred
replica all-reduce keeps (``set_requires_all_reduce(False)``), by bucket.
Nothing else records a reduction in flight: the root's
:class:`~shard_runtime._comm.CommContext` only orders the issued ones of
every unit, to bound how many are in flight together.

[Note: the path of one gradient]
From autograd's last accumulation into a full gradient to the sharded
gradient the optimizer reads, six functions, each in the module that owns
its decision:

1. ``UnitState._on_grad_ready`` (``_state.py``): the post-accumulate-grad
   hook counts the unit's gradients; once the unit's backward is done (see
   [Note: post-backward when the unit's backward is done]) it calls
2. ``UnitState.post_backward``: when the unit reduces, keeps the gradients
   (no gradient sync) or does nothing; it asks
3. ``Unit.reduce_grads`` (``_unit.py``) to issue the reduce-scatter on the
   reduce-scatter stream (how: groups, dtype, divide factors, comm hook),
   which returns an :class:`IssuedReduction` per gradient bucket, and hands each to
4. ``CommContext.queue`` (``_comm.py``), which lands the oldest reductions
   in flight while the root holds too many (and the end of a last backward
   lands the rest); landing is
5. :meth:`IssuedReduction.land`: wait for the collective, add a kept
   partial and run the replica all-reduce (or keep the sum as the new
   partial), the all-reduce hook and the division after it, then
6. ``UnitLayout.accumulate`` (``_per_param_layout.py`` or
   ``_flat_buffer_layout.py``) adds the reduced shard to each parameter's
   sharded gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shard_comms import CommHandle, DefaultGradReducer
from shard_core.protocols import EventLike, StreamLike
from shard_runtime._comm import CommStreams
from shard_runtime._unit_layout import GradPresence, UnitLayout, merge_presence

__all__ = ["IssuedReduction", "Reductions"]


@dataclass(eq=False, slots=True)
class Reductions:
    """What one unit has issued and not yet accumulated; see the module docstring."""

    layout: UnitLayout
    streams: CommStreams
    issued: list[IssuedReduction] = field(default_factory=list)
    # By bucket: reduce-scattered, waiting for the replica all-reduce
    # (set_requires_all_reduce(False)), with its presence.
    partials: dict[int, tuple[torch.Tensor, GradPresence]] = field(default_factory=dict)

    def land(self) -> None:
        """Land the reductions in flight, if any, in the order issued."""
        while self.issued:
            self.issued[0].land()

    def abandon(self) -> None:
        """Forget the kept partials (a step abandoned after an error); land the rest first."""
        self.land()
        self.partials.clear()


@dataclass(eq=False, slots=True)
class IssuedReduction:
    """One reduction issued on the reduce-scatter stream; :meth:`land` finishes it, once.

    Everything that decides how it lands was read when it was issued, so a
    reduction that lands after a later backward keeps the settings of its own
    (see ``set_is_last_backward``).
    """

    owner: Reductions
    bucket: int  # which of the layout's gradient buckets it reduces
    work: CommHandle
    output: torch.Tensor  # this rank's reduce-scattered shard
    issued: EventLike  # the end of the collective's call on the reduce-scatter stream
    presence: GradPresence
    # The replica all-reduce still to run at landing (``None``: no replicate group, or
    # the comm hook ran it).
    replicas: DefaultGradReducer | None
    all_reduce_now: bool  # False: keep the sum as the partial (set_requires_all_reduce(False))
    zero_unused: bool  # reduce_scatter_unused_params: parameters without a gradient get zeros
    all_reduce_hook: Callable[[torch.Tensor], None] | None
    all_reduce_hook_stream: StreamLike | None
    after_hook: float  # divided after the all-reduce hook
    keep_alive: tuple[torch.Tensor, ...] = field(default=())  # inputs held until it completes
    landed: bool = False

    def land(self) -> None:
        """Wait for the collective and accumulate its result into the sharded gradients."""
        if self.landed:
            return
        owner = self.owner
        self.work.wait()
        self.keep_alive = ()
        if self in owner.issued:
            owner.issued.remove(self)
        streams = owner.streams
        self.issued.wait(streams.current())  # See [Note: Stream ordering] in _comm.py.
        output, presence = self.output, self.presence
        if self.replicas is not None:
            kept = owner.partials.pop(self.bucket, None)
            if kept is not None:
                # The deferred sum joins this one before the replica all-reduce, so the
                # result is the eager one (see [Note: Comm hooks on the one reduction path]).
                output.add_(kept[0])
                presence = merge_presence(kept[1], presence)
            if not self.all_reduce_now:
                owner.partials[self.bucket] = (output, presence)
                self.landed = True
                return
            self.replicas.all_reduce_replicas(output)
        if self.all_reduce_hook is not None:
            self._run_all_reduce_hook(self.all_reduce_hook, streams)
        if self.after_hook != 1.0:
            output.div_(self.after_hook)
        owner.layout.accumulate(output, presence, zero_unused=self.zero_unused, bucket=self.bucket)
        self.landed = True

    def _run_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], streams: CommStreams
    ) -> None:
        """Call ``hook`` on the reduced shard, on the user's stream when one was given."""
        hook_stream = self.all_reduce_hook_stream
        if hook_stream is None:
            hook(self.output)
            return
        hook_stream.wait_stream(streams.current())
        with streams.handle.stream(hook_stream):
            hook(self.output)
        streams.current().wait_stream(hook_stream)
