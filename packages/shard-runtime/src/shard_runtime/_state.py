"""When a unit communicates: forward and backward hooks, and the root's step.

One :class:`ShardState` per ``fully_shard`` call (shared by every module of a
grouped call). It owns the unit and decides, from module hooks and autograd
hooks, when the unit gathers, frees and reduces:

- pre-forward: gather (or finish a prefetched gather), cast inputs;
- post-forward: free (unless kept), remember the order, hook the outputs;
- pre-backward (an output's gradient is ready): gather again, prefetch the
  unit that runs backward next;
- all of the unit's gradients accumulated: reduce-scatter, free;
- end of backward (a callback the root queues on the autograd engine):
  reduce what is left, wait for every reduction, reset for the next step.

[Note: the root]
The root is the outermost sharded module, found lazily at its first forward:
it keeps its parameters after forward (backward needs them at once), it owns
the post-forward order that drives backward prefetch, and it queues the
end-of-backward callback. A submodule's forward before the root has run once
has no root to report to, so it is an error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import nn
from torch.autograd import Variable

from shard_runtime._compile import eager_hook
from shard_runtime._options import MixedPrecisionPolicy
from shard_runtime._order import ForwardOrderChecker, order_check_enabled
from shard_runtime._tree import iter_tensors, map_tensors
from shard_runtime._unit import PendingReduce, ShardedState, TrainingState, Unit

__all__ = ["BackwardPrefetchMode", "ShardState", "clean_fqn", "get_state", "states_in"]

_log = logging.getLogger("shard.runtime")

_STATE_ATTR = "_shard_state"
WRAPPED_PREFIX = "_fsdp_wrapped_module."

BackwardPrefetchMode = Literal["pre", "post", "none"]


def clean_fqn(name: str) -> str:
    """A qualified name without the wrapper's internal ``_fsdp_wrapped_module`` segments."""
    return (
        name.replace(WRAPPED_PREFIX, "")
        .removesuffix("._fsdp_wrapped_module")
        .removeprefix("_fsdp_wrapped_module")
    )


def get_state(module: nn.Module) -> ShardState | None:
    """The state of a module passed to ``fully_shard``, or ``None``."""
    state = module.__dict__.get(_STATE_ATTR)
    return state if isinstance(state, ShardState) else None


def states_in(modules: Iterable[nn.Module]) -> list[ShardState]:
    """Every state in the trees of ``modules``, each once, in module order."""
    states: list[ShardState] = []
    for top in modules:
        for module in top.modules():
            state = get_state(module)
            if state is not None and state not in states:
                states.append(state)
    return states


class ShardState:
    """Hooks and step logic of one ``fully_shard`` call; see the module docstring."""

    def __init__(
        self,
        modules: list[nn.Module],
        unit: Unit,
        *,
        reshard_after_forward: bool,
        mp_policy: MixedPrecisionPolicy,
        backward_prefetch_mode: BackwardPrefetchMode = "pre",
        forward_prefetch_implicit: bool = False,
        cast_root_inputs: bool = False,
        limit_all_gathers: bool = False,
    ) -> None:
        self.modules = modules
        self.class_name = ",".join(type(m).__name__ for m in modules)
        self.unit = unit
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = mp_policy
        # - tree, filled by fully_shard and the root's lazy init
        self.parent: ShardState | None = None
        self.root: ShardState | None = None
        # - root only; see [Note: the root]
        self.all_states: list[ShardState] = []
        self.post_forward_order: list[ShardState] = []
        self._final_callback_queued = False
        self._pending_reduce: PendingReduce | None = None
        self.last_forward_order: list[ShardState] = []
        # - prefetch: explicit lists (FSDPModule), or the wrapper's implicit modes
        self.forward_prefetch: list[ShardState] | None = None
        self.backward_prefetch: list[ShardState] | None = None
        self.backward_prefetch_mode = backward_prefetch_mode
        self.forward_prefetch_implicit = forward_prefetch_implicit
        self.limit_all_gathers = limit_all_gathers
        self.cast_root_inputs = cast_root_inputs
        # - debug order check (root only): each unit's label as its forward starts,
        #   and the end of each backward
        self.on_forward_gather: Callable[[str], None] | None = None
        self.on_iteration_end: Callable[[], None] | None = None
        # - grouped modules: reshard once the last of them has run forward
        self._forwards_done: set[int] = set()
        unit.on_all_grads_ready = self._on_all_grads_ready
        # - entry points PyTorch calls, kept out of torch.compile; see [Note: torch.compile]
        #   in _compile.py
        self._pre_backward_entry = eager_hook(self._pre_backward_hook, "pre-backward hook")
        self._end_of_backward_entry = eager_hook(self._end_of_backward, "end-of-backward callback")
        pre_forward_entry = eager_hook(self._pre_forward_hook, "pre-forward hook")
        post_forward_entry = eager_hook(self._post_forward_hook, "post-forward hook")
        for module in modules:
            module.__dict__[_STATE_ATTR] = self
            module.register_forward_pre_hook(pre_forward_entry, prepend=True, with_kwargs=True)
            module.register_forward_hook(post_forward_entry, with_kwargs=True)
            module.register_state_dict_pre_hook(self._state_dict_pre_hook)  # type: ignore[no-untyped-call]

    @property
    def is_root(self) -> bool:
        """Whether this state is the root of its tree (decided at the first forward)."""
        return self.root is self

    @property
    def label(self) -> str:
        """The module's qualified name in the root's model, for errors and profiles."""
        return self.unit.label

    # ------------------------------------------------------------------ lazy init

    def _lazy_init(self) -> None:
        if self.parent is not None:
            outer = self.parent
            while outer.parent is not None:
                outer = outer.parent
            raise RuntimeError(
                f"fully_shard: the forward of {self.class_name} ({self.label!r}) ran before "
                f"the first forward of the root sharded module {outer.class_name}; run the root "
                "module's forward first (it sets up the whole tree), then submodules may run "
                "on their own"
            )
        states = states_in(self.modules)
        self.all_states = states
        self.name_inner_units()
        model_order = {
            name: index
            for top in self.modules
            for index, (name, _) in enumerate(top.named_parameters(remove_duplicate=False))
        }
        on_meta = sorted(
            (fqn for s in states for fqn in s.unit.group.meta_fqns()),
            key=lambda fqn: model_order.get(fqn, len(model_order)),
        )
        if on_meta:
            raise RuntimeError(
                "fully_shard: parameters are still on the meta device: "
                f"{', '.join(on_meta)}; call module.to_empty(device=...) and initialize them "
                "before the first forward"
            )
        for state in states:
            state.root = self
        if order_check_enabled() and self.on_forward_gather is None:
            checker = ForwardOrderChecker(None)
            self.on_forward_gather = checker.record
            self.on_iteration_end = checker.end_iteration

    def name_inner_units(self) -> None:
        """Label every unit below this one by its qualified name under this one's module(s)."""
        for top_index, top in enumerate(self.modules):
            top_prefix = f"{top_index}." if len(self.modules) > 1 else ""
            for name, module in top.named_modules():
                state = get_state(module)
                if state is None or state is self or module is not state.modules[0]:
                    continue
                state.unit.set_label(clean_fqn(f"{top_prefix}{name}"))

    # ------------------------------------------------------------------ forward

    def _pre_forward_hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return self.pre_forward(module, args, kwargs)

    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Gather the unit, start explicit prefetches, cast inputs."""
        if self.root is None:
            self._lazy_init()
        root = self.root
        assert root is not None
        if self is root and self.unit.training_state is TrainingState.IDLE:
            if root.post_forward_order:
                root.last_forward_order = list(root.post_forward_order)
            root.post_forward_order.clear()
        self.unit.training_state = TrainingState.FORWARD
        if root.on_forward_gather is not None:
            root.on_forward_gather(self.unit.comm_label)
        self.unit.unshard()
        for target in self._forward_prefetch_targets():
            self._prefetch(target)
        cast = self.mp_policy.cast_forward_inputs or (self.cast_root_inputs and self.is_root)
        if cast and self.mp_policy.param_dtype is not None:
            dtype = self.mp_policy.param_dtype
            args, kwargs = map_tensors(lambda t: _cast_floating(t, dtype), (args, kwargs))
        return args, kwargs

    def _post_forward_hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        return self.post_forward(module, output)

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Free the unit unless kept, record the order, hook the outputs for backward."""
        root = self.root
        assert root is not None
        grad_enabled = torch.is_grad_enabled()
        self._forwards_done.add(id(module))
        if len(self._forwards_done) >= len(self.modules):
            self._forwards_done.clear()
            # See [Note: the root]: it keeps its parameters for backward, not for eval.
            if self.reshard_after_forward and not (self.is_root and grad_enabled):
                if grad_enabled:
                    self.unit.reshard_post_forward()
                else:
                    self.unit.reshard()
        if self not in root.post_forward_order:
            root.post_forward_order.append(self)
        if grad_enabled:
            for tensor in iter_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._pre_backward_entry)  # type: ignore[no-untyped-call]
        if self.mp_policy.output_dtype is not None:
            dtype = self.mp_policy.output_dtype
            output = map_tensors(lambda t: _cast_floating(t, dtype), output)
        self.unit.training_state = TrainingState.IDLE
        return output

    # ------------------------------------------------------------------ backward

    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        self.pre_backward()

    def pre_backward(self) -> None:
        """Gather the unit for its backward and prefetch the next one."""
        root = self.root
        assert root is not None
        if not root._final_callback_queued:
            root._final_callback_queued = True
            Variable._execution_engine.queue_callback(root._end_of_backward_entry)
        if self.unit.training_state is TrainingState.PRE_BACKWARD:
            return
        self.unit.training_state = TrainingState.PRE_BACKWARD
        self.unit.unshard()
        if self.backward_prefetch is not None or self.backward_prefetch_mode == "pre":
            for target in self._backward_prefetch_targets():
                self._prefetch(target)

    def _prefetch(self, target: ShardState) -> None:
        """Start ``target``'s all-gather unless it is gathered or too many are in flight."""
        if target.unit.sharded_state is ShardedState.UNSHARDED:
            return
        root = self.root
        assert root is not None
        if root.limit_all_gathers:
            # At most two units' all-gathers in flight bounds the memory they hold.
            in_flight = sum(1 for s in root.all_states if s.unit._pending_gather is not None)
            if in_flight >= 2:
                return
        target.unit.unshard(async_op=True)

    def _forward_prefetch_targets(self) -> list[ShardState]:
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        if not self.forward_prefetch_implicit:
            return []
        root = self.root
        assert root is not None
        order = root.last_forward_order
        if self not in order:
            return []
        index = order.index(self)
        return [order[index + 1]] if index + 1 < len(order) else []

    def _backward_prefetch_targets(self) -> list[ShardState]:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        if self.backward_prefetch_mode == "none":
            return []
        root = self.root
        assert root is not None
        order = root.post_forward_order
        if self not in order:
            return []
        index = order.index(self)
        return [order[index - 1]] if index > 0 else []

    def _on_all_grads_ready(self, unit: Unit) -> None:
        self._post_backward()

    def _post_backward(self) -> None:
        unit = self.unit
        if unit.training_state is TrainingState.POST_BACKWARD:
            return
        root = self.root
        assert root is not None
        if self.backward_prefetch is None and self.backward_prefetch_mode == "post":
            for target in self._backward_prefetch_targets():
                self._prefetch(target)
        if unit.requires_gradient_sync:
            root._queue_reduce(unit.reduce_grads())
        if unit.reshard_after_backward:
            unit.reshard()
        unit.training_state = TrainingState.POST_BACKWARD

    def _queue_reduce(self, pending: PendingReduce | None) -> None:
        # One reduction in flight at a time bounds the memory held by reduce buffers.
        if self._pending_reduce is not None:
            self._pending_reduce.finish()
        self._pending_reduce = pending

    def _end_of_backward(self) -> None:
        for state in self.all_states:
            unit = state.unit
            if unit._pending_gather is not None:
                # A prefetch nobody consumed: its data would be stale after the optimizer step.
                unit.reshard()
            if unit.training_state is not TrainingState.POST_BACKWARD and (
                unit.sharded_state is ShardedState.UNSHARDED or unit.has_unsharded_grads()
            ):
                state._post_backward()
            elif unit.sharded_state is ShardedState.SHARDED_POST_FORWARD or (
                unit.sharded_state is ShardedState.UNSHARDED and unit.reshard_after_backward
            ):
                unit.reshard()
        self._queue_reduce(None)
        for state in self.all_states:
            state.unit.reset_backward()
            state.unit.training_state = TrainingState.IDLE
        self._final_callback_queued = False
        if self.on_iteration_end is not None:
            self.on_iteration_end()
        _log.debug("shard: end of backward for %d units", len(self.all_states))

    # ------------------------------------------------------------------ state dict

    def _state_dict_pre_hook(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if self.unit.sharded_state is ShardedState.UNSHARDED:
            self.unit.reshard()


def _cast_floating(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if torch.is_floating_point(tensor) and tensor.dtype != dtype:
        return tensor.to(dtype)
    return tensor
