"""When a unit communicates: forward and backward hooks, and the root's step.

One :class:`UnitState` per ``fully_shard`` call (shared by every module of a
grouped call) or wrapper; it holds no front-end branch: what differs between
the two comes in as :class:`~shard_runtime._front_end.FrontEndRules`. It
owns the unit (one per mesh when ``shard_placement_fn`` puts the call's
parameters on several: see [Note: one unit per process group] in
``_mesh_groups.py``; they always move together) and decides, from module
hooks and autograd hooks, when the unit gathers, frees and reduces:

- pre-forward: gather (or finish a prefetched gather), cast inputs;
- post-forward: free (unless kept), remember the order, hook the outputs;
- pre-backward (an output's gradient is ready): gather again, prefetch the
  unit that runs backward next;
- all of the unit's gradients accumulated: reduce-scatter, free;
- end of backward (a callback the root queues on the autograd engine):
  reduce what is left, wait for every reduction (unless told this is not
  the last backward), reset for the next step.

[Note: the root]
The root is the sharded module whose forward runs first, found lazily then:
it owns the post-forward order that drives backward prefetch, and it queues
the end-of-backward callback. Backward needs its parameters at once, so it
keeps them after forward unless told otherwise. The two front ends copy
different PyTorch rules here, and each says which in its
:class:`~shard_runtime._front_end.FrontEndRules`:

- ``fully_shard`` (FSDP2's rules): ``reshard_after_forward=None`` means
  "``True``, except ``False`` for the root", resolved at lazy init; an explicit
  ``True`` on the root reshards it after every forward, eval included. A
  submodule whose forward runs before its root's becomes the root of its own
  subtree, and the real root's first forward then fails: the tree was set up
  from the wrong end.
- the wrapper (FSDP1's rules, ``root_keeps_params_for_backward`` and
  ``early_forward_is_error``): the root keeps its parameters after a forward
  with grad enabled whatever ``reshard_after_forward`` says, and a
  submodule's forward before the root has run once is an error.

Under either, the modules grouped by one ``fully_shard([a, b])`` call cannot
be the root (they have no single forward to start and end the step).

[Note: recovering from a failed step]
An exception in the middle of forward or backward leaves units gathered, a
reduction in flight, training states half-way and the end-of-backward callback
marked as queued (autograd drops it with the failed graph). ``reset_iter_state``
on the root waits for what is in flight (a collective cannot be abandoned on
one rank), discards the step's unreduced gradients (full gradients not yet
reduced, a deferred replica all-reduce), reshards every unit and clears the
per-step bookkeeping, so the next step starts clean. Reductions already issued
land in the sharded gradients, as in PyTorch (whose gradients are assigned when
the reduction is issued); ``optimizer.zero_grad()`` clears them as usual.

[Note: a backward that is not the last]
By default the end of backward lands every reduction still in flight (waits
for it and accumulates its result into the sharded gradients), so gradients
are complete when ``loss.backward()`` returns. After
``set_is_last_backward(False)`` on the root, the end of backward leaves the
reductions in flight (at most ``set_reduce_scatter_max_input_buffers`` of
them, the last units reduced), so they overlap the next micro-batch's forward.
Nothing else changes: units still reduce, reshard and reset as usual, and the
forward order is rebuilt by every root forward. A pending reduction lands,
once, at the first of:

- the next reduction issued while the root's context is full (oldest first),
  and in any case before its own unit's next reduction, so one unit's
  reductions (and a deferred replica partial) land in the order issued;
- the end of a backward whose ``is_last_backward`` is ``True``;
- anything through shard that reads or replaces gradients or shards: the
  state dict, ``reset_iter_state``, explicit ``unshard()``/``reshard()``,
  ``.to()``/``to_empty()`` (``_apply``), ``share_comm_ctx``, and any
  optimizer step, in backward or after it (see [Note: optimizer step guard]).

Gradients read directly (``param.grad``) miss what is in flight: read them
after a backward with ``True``.

[Note: post-backward when the unit's backward is done]
A unit reduces its gradients and frees its full parameters once its backward
is over, not merely once its trainable parameters have gradients: autograd
may still need a frozen weight after that, to carry the gradient on to the
unit's input (a LoRA layer, ``base(x) + b(a(x))`` with ``base`` frozen:
``b`` and ``a`` have their gradients before ``base``'s weight is used for
``x``'s). So the post-backward waits for two things:

- every trainable parameter's gradient is accumulated (the unit counts the
  gradient-ready hooks), which covers gradients that reach a parameter on a
  path that does not lead back to the input; and
- the gradient of every forward input that requires one is computed: each
  forward of the unit passes those inputs through :class:`_BackwardDone`,
  an identity whose backward counts down ``inputs_pending``.

Whichever comes last runs the post-backward, so the reduce-scatter still
starts while autograd moves on to the unit before (the overlap). A unit whose
inputs need no gradient (the first layer, the root) has only the first
condition, and it suffices only when every parameter of the unit signals a
gradient (none frozen, or the flat layout, whose frozen originals are views of
the trainable buffer): a frozen weight of such a unit may be needed until the
very end (the root's frozen final norm, between the trainable head and the
blocks), so its post-backward waits for the end of backward, as PyTorch's.
A unit that got no gradient at all, or whose
counted forwards never all ran backward (a forward whose output was not used
in the loss), is reduced by the end-of-backward callback, which also resets
the counts. A forward run again inside the unit's own backward (activation
checkpointing recomputing it) only casts: the parameters are gathered for the
backward already, and it is no new use of the unit.

[Note: parameters replaced before the first forward]
``fully_shard`` registers each parameter's sharded DTensor on its module; a
user may replace it before training starts (``module.weight =
nn.Parameter(distribute_tensor(...))``, a loader assigning tensors). At lazy
init, and before an explicit ``unshard()``, the unit adopts a DTensor
parameter of the same global shape, mesh and placements: its local tensor
becomes the shard that forward gathers. A plain (full) tensor is refused with
PyTorch's exception type, AttributeError, naming the parameter and the fix.

[Note: free, then reduce]
Post-backward frees a unit's full parameters before it builds the
reduction's input: the reduce-scatter needs the full gradients and a buffer
for them (a cast to ``reduce_dtype``, or padded rows), never the full
parameters. Reducing first held all three at once, one unit's full
parameters more at the backward's peak than PyTorch, which frees first too
(24 MiB in an 8-layer, d_model 1024 bf16 GPT on an H200; 4-6 MiB on the CPU
with glibc's ``mallinfo2`` read after every operation of a backward;
``tests/test_post_backward_memory.py`` checks the order). What remains
above PyTorch on the CPU is the reduction shard keeps in flight while the
next unit's backward runs (``reduce_scatter_max_input_buffers``, 1 by
default): the price of overlapping it.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor

from shard_comms.plumbing import set_flight_step
from shard_runtime._comm import CommContext
from shard_runtime._compile import eager_hook
from shard_runtime._fingerprint import check_same_model
from shard_runtime._front_end import FrontEndRules
from shard_runtime._host_memory import release_host_memory, releases_after_backward
from shard_runtime._options import MixedPrecisionPolicy
from shard_runtime._order import ForwardOrderChecker, order_check_enabled
from shard_runtime._reduction import IssuedReduction
from shard_runtime._step_guard import watch_root
from shard_runtime._tree import iter_tensors, map_tensors
from shard_runtime._unit import ShardedState, TrainingState, Unit, raise_on_meta

__all__ = ["UnitState", "get_state", "states_in"]

_log = logging.getLogger("shard.runtime")

_STATE_ATTR = "_shard_state"

_Inputs = tuple[tuple[Any, ...], dict[str, Any]]
_T = TypeVar("_T")


def get_state(module: nn.Module) -> UnitState | None:
    """The state of a module passed to ``fully_shard``, or ``None``."""
    state = module.__dict__.get(_STATE_ATTR)
    return state if isinstance(state, UnitState) else None


def states_in(modules: Iterable[nn.Module]) -> list[UnitState]:
    """Every state in the trees of ``modules``, each once, in module order."""
    states: list[UnitState] = []
    for top in modules:
        for module in top.modules():
            state = get_state(module)
            if state is not None and state not in states:
                states.append(state)
    return states


class UnitState:
    """Hooks and step logic of one ``fully_shard`` call or wrapper; see the module docstring.

    It drives one unit, or several when the call's parameters are on several
    meshes (see [Note: one unit per process group] in ``_mesh_groups.py``):
    they gather, free and reduce together, and share one training state.
    """

    def __init__(
        self,
        modules: list[nn.Module],
        units: list[Unit],
        *,
        rules: FrontEndRules,
        mp_policy: MixedPrecisionPolicy,
    ) -> None:
        assert units, "a state drives at least one unit"
        self.modules = modules
        self.class_name = ",".join(type(m).__name__ for m in modules)
        self.units = units
        self.mp_policy = mp_policy
        self.rules = rules  # See [Note: the root].
        # - tree: the parent is set when the enclosing state is built, the root at lazy init
        self.parent: UnitState | None = None
        self.root: UnitState | None = None
        # Raised by the root's lazy init, first forward: errors the front end found when the
        # state was built but PyTorch reports there (see [Note: a weight tied across two
        # calls] in _fully_shard.py).
        # Each is called with the root.
        self.lazy_init_errors: list[Callable[[UnitState], Exception]] = []
        # - root only; see [Note: the root]
        self.all_states: list[UnitState] = []
        self.post_forward_order: list[UnitState] = []
        self._final_callback_queued = False
        self.is_last_backward = True  # See [Note: a backward that is not the last].
        self.last_forward_order: list[UnitState] = []
        self.step = 0  # backwards completed: the step the flight recorder names
        # - prefetch: explicit lists (FSDPModule), else the rules' modes
        self.forward_prefetch: list[UnitState] | None = None
        self.backward_prefetch: list[UnitState] | None = None
        # - debug order check (root only): each unit's label as its forward starts,
        #   and the end of each backward
        self.on_forward_gather: Callable[[str], None] | None = None
        self.on_iteration_end: Callable[[], None] | None = None
        self.on_iteration_abort: Callable[[], None] | None = None
        # - grouped modules: reshard once the last of them has run forward
        self._forwards_done: set[int] = set()
        # - forwards whose inputs' gradients backward has not computed yet; see
        #   [Note: post-backward when the unit's backward is done]
        self.inputs_pending = 0
        self.inputs_watched = False  # a forward since the last backward watched its inputs
        self.grads_ready = 0  # gradient-ready signals in this backward
        # An output of a forward since the last backward needs a gradient: only then does the
        # unit have a backward to gather for (a frozen unit before every trainable one has none).
        self.runs_backward = False
        # See [Note: torch.compile] in _compile.py.
        on_grad_ready = eager_hook(_weak_grad_hook(self), "post-accumulate-grad hook")
        for unit in units:
            unit.hook_gradients(on_grad_ready)
        # - entry points PyTorch calls, kept out of torch.compile; see [Note: torch.compile]
        #   in _compile.py
        self._pre_backward_entry = eager_hook(self._pre_backward_hook, "pre-backward hook")
        self._end_of_backward_entry = eager_hook(self.end_of_backward, "end-of-backward callback")
        pre_forward_entry = eager_hook(self._pre_forward_hook, "pre-forward hook")
        post_forward_entry = eager_hook(self._post_forward_hook, "post-forward hook")
        for module in modules:
            module.__dict__[_STATE_ATTR] = self
            module.register_forward_pre_hook(pre_forward_entry, prepend=True, with_kwargs=True)
            module.register_forward_hook(post_forward_entry, with_kwargs=True)
            module.register_state_dict_pre_hook(self._state_dict_pre_hook)  # type: ignore[no-untyped-call]
            module.register_load_state_dict_pre_hook(self._load_state_dict_pre_hook)  # type: ignore[no-untyped-call]
        # Sharded inner-first: every state below that has no parent yet is a child of this one.
        for inner in states_in(modules):
            if inner is not self and inner.parent is None:
                inner.parent = self
        self.name_inner_units()

    @property
    def is_root(self) -> bool:
        """Whether this state is the root of its tree (decided at the first forward)."""
        return self.root is self

    @property
    def unit(self) -> Unit:
        """The state's one unit (every wrapper; a ``fully_shard`` call on one mesh).

        Raises:
            AssertionError: the call's parameters are on several meshes; use ``units``.
        """
        if len(self.units) != 1:
            raise AssertionError(
                f"{self.rules.api}({self.label or 'root'}) has {len(self.units)} units (its "
                "parameters are on several meshes); code that may meet such a state reads "
                "UnitState.units"
            )
        return self.units[0]

    @property
    def label(self) -> str:
        """The module's qualified name in the root's model, for errors and profiles."""
        return self.units[0].label

    @property
    def training_state(self) -> TrainingState:
        """Where the state's units are in the step (they move together)."""
        return self.units[0].training_state

    def _enter(self, training_state: TrainingState) -> None:
        for unit in self.units:
            unit.training_state = training_state

    @property
    def comm_ctx(self) -> CommContext:
        """The reductions in flight this state bounds where it is the root (see ``_comm.py``)."""
        return self.units[0].comm_ctx

    @property
    def num_trainable(self) -> int:
        """Trainable parameters over every unit: the gradient-ready signals a backward sends."""
        return sum(unit.layout.num_trainable for unit in self.units)

    # ------------------------------------------------------------------ lazy init

    def _lazy_init(self) -> None:
        """Make this state the root of every state in its modules' trees; see [Note: the root]."""
        self._check_can_be_root()
        states = states_in(self.modules)
        early = [s for s in states if s is not self and s.root is not None]
        if early:
            raise RuntimeError(
                f"{self.rules.api}: {early[0].class_name} ({early[0].label!r}) already ran "
                f"forward as a root before the first forward of {self.class_name}, the sharded "
                "module that contains it; run the outermost sharded module's forward first (it "
                "sets up the whole tree), then submodules may run on their own"
            )
        for state in states:
            if state.lazy_init_errors:
                raise state.lazy_init_errors[0](self)
        for state in states:
            state.adopt_replaced_params()
        self.all_states = states
        self.name_inner_units()
        self._check_materialized(states)
        # See [Note: model fingerprints] in _fingerprint.py: before any collective of the model.
        check_same_model([u for s in states for u in s.units], api=self.rules.api)
        for state in states:
            state.root = self
            for unit in state.units:
                if unit.reshard_after_forward is None:
                    # See [Note: the root]: backward needs the root's parameters at once.
                    unit.reshard_after_forward = state is not self
        watch_root(self)  # See [Note: optimizer step guard] in _step_guard.py.
        if order_check_enabled() and self.on_forward_gather is None:
            checker = ForwardOrderChecker(None)
            self.on_forward_gather = checker.record
            self.on_iteration_end = checker.end_iteration
            self.on_iteration_abort = checker.abandon_iteration

    def _check_can_be_root(self) -> None:
        """Raise if the rules say this state's forward cannot start a step."""
        if self.parent is not None and self.rules.early_forward_is_error:
            outer = self.parent
            while outer.parent is not None:
                outer = outer.parent
            raise RuntimeError(
                f"{self.rules.api}: the forward of {self.class_name} ({self.label!r}) ran "
                f"before the first forward of the root sharded module {outer.class_name}; run "
                "the root module's forward first (it sets up the whole tree), then submodules "
                "may run on their own"
            )
        if len(self.modules) > 1:
            raise RuntimeError(
                f"{self.rules.api}: the modules grouped by one fully_shard([...]) call "
                f"({self.class_name}) ran forward as the root; a root must be one module: also "
                "apply fully_shard to the module that contains them (fully_shard(model)), after "
                "the grouped call"
            )

    def _check_materialized(self, states: list[UnitState]) -> None:
        """Raise naming every parameter of the tree still on the meta device, in model order."""
        model_order = {
            name: index
            for top in self.modules
            for index, (name, _) in enumerate(top.named_parameters(remove_duplicate=False))
        }
        on_meta = sorted(
            (fqn for s in states for u in s.units for fqn in u.layout.meta_fqns()),
            key=lambda fqn: model_order.get(fqn, len(model_order)),
        )
        if on_meta:
            raise_on_meta(self.rules.api, on_meta)

    def name_inner_units(self) -> None:
        """Label every unit below this one by its qualified name under this one's module(s)."""
        for top_index, top in enumerate(self.modules):
            top_prefix = f"{top_index}." if len(self.modules) > 1 else ""
            for name, module in top.named_modules():
                state = get_state(module)
                if state is None or state is self or module is not state.modules[0]:
                    continue
                for unit in state.units:
                    unit.set_label(self.rules.clean_name(f"{top_prefix}{name}"))

    # ------------------------------------------------------------------ forward

    def _pre_forward_hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return self.pre_forward(module, args, kwargs)

    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Gather the units, start explicit prefetches, cast inputs."""
        if self.training_state is TrainingState.PRE_BACKWARD:
            # Recomputed inside its own backward; see [Note: post-backward when the unit's
            # backward is done].
            return self._cast_inputs(args, kwargs)
        if self.root is None:
            self._lazy_init()
        root = self.root
        assert root is not None
        if self is root and self.training_state is TrainingState.IDLE:
            if root.post_forward_order:
                root.last_forward_order = list(root.post_forward_order)
            root.post_forward_order.clear()
            set_flight_step(root.step)
        self._enter(TrainingState.FORWARD)
        if root.on_forward_gather is not None:
            root.on_forward_gather(self.units[0].comm_label)
        for unit in self.units:
            unit.sync_requires_grad()  # See [Note: requires_grad is read at every forward].
            unit.drop_stale_copy()
            unit.unshard()
        for target in self._forward_prefetch_targets():
            self._prefetch(target)
        if torch.is_grad_enabled():
            args, kwargs = self._watch_input_grads((args, kwargs))
        return self._cast_inputs(args, kwargs)

    def _cast_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        cast = self.mp_policy.cast_forward_inputs or (self.rules.cast_root_inputs and self.is_root)
        if cast and self.mp_policy.param_dtype is not None:
            dtype = self.mp_policy.param_dtype
            args, kwargs = map_tensors(lambda t: _cast_floating(t, dtype), (args, kwargs))
        return args, kwargs

    def _watch_input_grads(self, inputs: _Inputs) -> _Inputs:
        """Pass the inputs that need a gradient through :class:`_BackwardDone`.

        See [Note: post-backward when the unit's backward is done].
        """
        needing: dict[int, torch.Tensor] = {}

        def collect(t: torch.Tensor) -> torch.Tensor:
            if t.requires_grad:
                needing.setdefault(id(t), t)
            return t

        map_tensors(collect, inputs)
        if not needing:
            return inputs
        self.inputs_pending += 1
        self.inputs_watched = True
        watched = _BackwardDone.apply(weakref.ref(self), *needing.values())  # type: ignore[no-untyped-call]
        by_id = dict(zip(needing, watched, strict=True))
        result: _Inputs = map_tensors(lambda t: by_id.get(id(t), t), inputs)
        return result

    def _on_inputs_grad_ready(self) -> None:
        self.inputs_pending -= 1
        if self._backward_done():
            self.post_backward()

    def _backward_done(self) -> bool:
        """Whether the unit's backward is over; see [Note: post-backward when the unit's
        backward is done]."""
        if self.inputs_pending or self.grads_ready < self.num_trainable:
            return False
        return self.inputs_watched or all(u.layout.signals_every_param for u in self.units)

    def _post_forward_hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        return self.post_forward(module, output)

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Free the units unless kept, record the order, hook the outputs for backward."""
        if self.training_state is TrainingState.PRE_BACKWARD:
            # Recomputed inside its own backward; see [Note: post-backward when the unit's
            # backward is done].
            return self._cast_output(output)
        root = self.root
        assert root is not None
        grad_enabled = torch.is_grad_enabled()
        self._forwards_done.add(id(module))
        if len(self._forwards_done) >= len(self.modules):
            self._forwards_done.clear()
            for unit in self.units:
                if unit.reshard_after_forward is True or not grad_enabled:
                    # As PyTorch's wrapper at such a forward's end (FULL_SHARD, HYBRID_SHARD,
                    # the root too; any strategy under no_grad): frozen parameters lose the
                    # gradients they kept, even in a unit that has nothing to reduce.
                    unit.layout.release_frozen_grads()
                if self._reshards_after_forward(unit, grad_enabled):
                    if grad_enabled:
                        unit.reshard_post_forward()
                    else:
                        unit.reshard()
                    continue
                if grad_enabled:
                    # [Note: a forward whose backward may never come]
                    # A unit left unsharded for backward (the wrapper's root; SHARD_GRAD_OP,
                    # NO_SHARD) computes with views in place of its parameters, and the
                    # backward that would reshard it may never run: a loss computed for
                    # logging without torch.no_grad(), say. Until then named_parameters()
                    # would lack them (requires_grad_, clipping, EMA and logging loops see
                    # nothing), so they are listed again now, the views staying for the
                    # backward. PyTorch's FSDP1 lists the views themselves there (not
                    # leaves: requires_grad_ on them raises).
                    unit.layout.show_params_beside_views()
                # See [Note: a kept unsharded copy is checked before reuse] in _unit.py.
                unit.keep_unsharded()
        if self not in root.post_forward_order:
            root.post_forward_order.append(self)
        if grad_enabled:
            for tensor in iter_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._pre_backward_entry)  # type: ignore[no-untyped-call]
                    self.runs_backward = True
        self._enter(TrainingState.IDLE)
        return self._cast_output(output)

    def _cast_output(self, output: Any) -> Any:
        if self.mp_policy.output_dtype is not None:
            dtype = self.mp_policy.output_dtype
            output = map_tensors(lambda t: _cast_floating(t, dtype), output)
        return output

    def _reshards_after_forward(self, unit: Unit, grad_enabled: bool) -> bool:
        if not grad_enabled and unit.layout.hides_params_while_unsharded:
            # [Note: an evaluation forward reshards hidden parameters]
            # The wrapper's use_orig_params=True units compute with plain views in place of
            # the original parameters, which come back when the unit reshards. After a
            # training forward the backward does that; after one under torch.no_grad()
            # (validation) nothing would until the next step, and named_parameters() would
            # lack them meanwhile (requires_grad_, clipping, EMA and logging loops then see
            # nothing). So such a forward reshards them, also under SHARD_GRAD_OP and
            # NO_SHARD, at the price of a gather at the next forward (PyTorch's FSDP1 keeps
            # them, as Parameters holding the full views).
            return True
        if unit.reshard_after_forward is False:
            return False
        # See [Note: the root]: under the wrapper's rules the root keeps its parameters for
        # backward, not for eval.
        return not (self.rules.root_keeps_params_for_backward and self.is_root and grad_enabled)

    # ------------------------------------------------------------------ replaced parameters

    def adopt_replaced_params(self) -> None:
        """Adopt sharded parameters the user registered in place of the unit's own.

        See [Note: parameters replaced before the first forward].
        """
        for unit in self.units:
            if unit.sharded_state is not ShardedState.SHARDED:
                continue
            if unit.layout.adopt_replaced_params(self._check_replacement):
                unit.reset_after_apply()

    def _check_replacement(self, fqn: str, new: object, old: nn.Parameter) -> None:
        """Raise unless ``new`` can stand in for the sharded parameter ``old``."""
        where = (
            f"{self.rules.api}({self.units[0].comm_label}): parameter {fqn!r} was replaced after "
            f"{self.rules.api}"
        )
        assert isinstance(old, DTensor)
        if not isinstance(new, DTensor):
            seen = (
                "None"
                if not isinstance(new, torch.Tensor)
                else (f"a {type(new).__name__} of shape {tuple(new.shape)}")
            )
            raise AttributeError(
                f"{where} by {seen}, not a DTensor sharded like the original; assign "
                f"nn.Parameter(distribute_tensor(value, mesh, {list(old.placements)})) instead, "
                "or copy the values into the existing parameter: with torch.no_grad(): "
                "param.copy_(distribute_tensor(value, param.device_mesh, param.placements))"
            )
        if (
            new.shape != old.shape
            or new.device_mesh != old.device_mesh
            or tuple(new.placements) != tuple(old.placements)
            or new.requires_grad != old.requires_grad
        ):
            raise ValueError(
                f"{where} by a DTensor of shape {tuple(new.shape)}, placements "
                f"{tuple(new.placements)}, requires_grad={new.requires_grad} on mesh "
                f"{new.device_mesh}; the unit shards it as shape {tuple(old.shape)}, placements "
                f"{tuple(old.placements)}, requires_grad={old.requires_grad} on mesh "
                f"{old.device_mesh}: assign a DTensor that matches, or copy the values into the "
                "existing parameter"
            )

    def around_apply(self, apply: Callable[[], _T]) -> _T:
        """Run ``apply`` (the module's ``_apply``: ``.to()``, ``.float()``, ``to_empty()``).

        It swaps new local tensors into the sharded parameters, so what is in
        flight lands first (see [Note: a backward that is not the last]), the
        unit is sharded while it runs, and adopts the new tensors afterwards.
        """
        self.land_reductions()
        for unit in self.units:
            unit.reshard()
        result = apply()
        for unit in self.units:
            unit.reset_after_apply()
        return result

    # ------------------------------------------------------------------ recovery

    def reset_iter_state(self) -> None:
        """Abandon a step that raised; see [Note: recovering from a failed step]."""
        if self.root is not None and self.root is not self:
            raise RuntimeError(
                f"reset_iter_state must be called on the root sharded module, not on "
                f"{self.class_name} ({self.label!r}); call it on the module whose forward "
                f"runs first, {self.root.class_name}"
            )
        self.land_reductions()  # reductions issued land, as in PyTorch
        for state in self.all_states or states_in(self.modules):
            for unit in state.units:
                unit.reshard()  # waits for a gather in flight
                unit.layout.drop_unsharded_grads()
                unit.reductions.abandon()  # a deferred replica partial
            state._forwards_done.clear()
            state._reset_backward()
        self.post_forward_order.clear()
        self._final_callback_queued = False
        if self.on_iteration_abort is not None:
            self.on_iteration_abort()

    # ------------------------------------------------------------------ backward

    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        self.pre_backward()

    def pre_backward(self) -> None:
        """Gather the units for their backward and prefetch the next state's."""
        root = self.root
        assert root is not None
        if not root._final_callback_queued:
            root._final_callback_queued = True
            Variable._execution_engine.queue_callback(root._end_of_backward_entry)
        if self.training_state is TrainingState.PRE_BACKWARD:
            return
        self._enter(TrainingState.PRE_BACKWARD)
        for unit in self.units:
            unit.unshard()
        if self.backward_prefetch is not None or self.rules.backward_prefetch == "pre":
            for target in self._backward_prefetch_targets():
                if target.runs_backward:
                    self._prefetch(target, backward=True)

    def _prefetch(self, target: UnitState, *, backward: bool = False) -> None:
        """Start ``target``'s all-gathers unless gathered or too many are in flight.

        In backward, units that do not gather for their backward
        (``unshard_in_backward=False``) are left alone.
        """
        root = self.root
        assert root is not None
        for unit in target.units:
            if unit.sharded_state is ShardedState.UNSHARDED:
                continue
            if backward and not unit.unshard_in_backward:
                continue
            if root.rules.limit_all_gathers:
                # At most two units' all-gathers in flight bounds the memory they hold.
                in_flight = sum(1 for s in root.all_states for u in s.units if u.gather_in_flight)
                if in_flight >= 2:
                    return
            unit.unshard(async_op=True)

    def _forward_prefetch_targets(self) -> list[UnitState]:
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        if not self.rules.forward_prefetch:
            return []
        root = self.root
        assert root is not None
        order = root.last_forward_order
        if self not in order:
            return []
        index = order.index(self)
        return [order[index + 1]] if index + 1 < len(order) else []

    def _backward_prefetch_targets(self) -> list[UnitState]:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        if self.rules.backward_prefetch == "none":
            return []
        root = self.root
        assert root is not None
        order = root.post_forward_order
        if self not in order:
            return []
        index = order.index(self)
        return [order[index - 1]] if index > 0 else []

    def _on_grad_ready(self, _param: torch.Tensor) -> None:
        """Autograd accumulated a trainable parameter's full gradient.

        Step 1 of [Note: the path of one gradient] in ``_reduction.py``.
        """
        self.grads_ready += 1
        if self.grads_ready == self.num_trainable and self._backward_done():
            self.post_backward()

    def post_backward(self, *, prefetch: bool = True) -> None:
        """The backward is over: reduce (or keep) the units' gradients, free their parameters.

        Step 2 of [Note: the path of one gradient] in ``_reduction.py``. Once per
        backward: a state that already reduced does nothing, so a driver that runs
        backward itself (``torch.distributed.pipelining``, ``_torch_state_view.py``)
        may call it after its last micro-batch. ``prefetch=False`` (the end-of-backward
        callback) starts no ``BACKWARD_POST`` prefetch: no backward is left to use it.
        """
        if self.training_state is TrainingState.POST_BACKWARD:
            return
        root = self.root
        assert root is not None
        if prefetch and self.backward_prefetch is None and self.rules.backward_prefetch == "post":
            for target in self._backward_prefetch_targets():
                if target.runs_backward:
                    self._prefetch(target, backward=True)
        issued: list[IssuedReduction] = []
        limit = 1
        # The last unit first, as autograd reaches them in PyTorch (the order of the units'
        # own reductions is free: each has its own process group).
        for unit in reversed(self.units):
            if unit.reshard_after_backward:
                # Before the reduction allocates its input: see [Note: free, then reduce].
                unit.reshard()
            else:
                unit.keep_unsharded()
            if unit.requires_gradient_sync:
                # A unit without gradients issues nothing and leaves the others in flight.
                reductions = unit.reduce_grads()
                if reductions:
                    issued.extend(reductions)
                    limit = max(limit, unit.reduce_scatter_max_input_buffers)
            else:
                unit.layout.keep_grads(unit.mp_policy.reduce_dtype)
            unit.training_state = TrainingState.POST_BACKWARD
        if issued:
            # At most ``reduce_scatter_max_input_buffers`` states' reductions in flight bounds
            # the memory their buffers hold; see [Note: Sharing the communication context].
            root.comm_ctx.queue(issued, limit)

    def land_reductions(self) -> None:
        """Land every reduction this tree has in flight.

        See [Note: a backward that is not the last].
        """
        root = self.root if self.root is not None else self
        root.comm_ctx.land()

    def end_of_backward(self) -> None:
        for state in self.all_states:
            for unit in state.units:
                if unit.gather_in_flight:
                    # A prefetch nobody consumed: its data would be stale after the optimizer
                    # step.
                    unit.reshard()
            if state.training_state is not TrainingState.POST_BACKWARD and any(
                unit.sharded_state is ShardedState.UNSHARDED
                or unit.has_unsharded_grads()
                or unit.reduce_scatter_unused_params
                for unit in state.units
            ):
                state.post_backward(prefetch=False)
                continue
            for unit in state.units:
                if unit.sharded_state is ShardedState.SHARDED_POST_FORWARD or (
                    unit.sharded_state is ShardedState.UNSHARDED and unit.reshard_after_backward
                ):
                    unit.reshard()
        if self.is_last_backward:  # See [Note: a backward that is not the last].
            self.land_reductions()
        for state in self.all_states:
            state._reset_backward()
        self._final_callback_queued = False
        self.step += 1
        if releases_after_backward():
            release_host_memory()
        set_flight_step(self.step)
        if self.on_iteration_end is not None:
            self.on_iteration_end()
        _log.debug("shard: end of backward for %d units", len(self.all_states))

    def _reset_backward(self) -> None:
        """Forget this backward's bookkeeping (at its end, or when a step is abandoned)."""
        self._enter(TrainingState.IDLE)
        self.grads_ready = 0
        self.inputs_pending = 0
        self.inputs_watched = False
        self.runs_backward = False

    # ------------------------------------------------------------------ state dict

    def _state_dict_pre_hook(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self._to_sharded()

    def _load_state_dict_pre_hook(self, module: nn.Module, *args: object) -> None:
        # A unit a forward left gathered registers its unsharded parameters (fully_shard), into
        # which a sharded state dict cannot be copied; the wrapper's own load (a hook of its
        # own, registered after this one) writes the shards.
        self._to_sharded()

    def _to_sharded(self) -> None:
        """Land the reductions in flight and reshard the units left gathered: what a state
        dict is read from and loaded into is the sharded parameters."""
        self.land_reductions()  # See [Note: a backward that is not the last].
        for unit in self.units:
            if unit.sharded_state is ShardedState.UNSHARDED:
                unit.reshard()


def _cast_floating(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if torch.is_floating_point(tensor) and tensor.dtype != dtype:
        return tensor.to(dtype)
    return tensor


class _BackwardDone(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward says their gradients are computed.

    See [Note: post-backward when the unit's backward is done]. It holds the
    state weakly, as the gradient hooks do (see [Note: Gradient hooks hold the
    unit weakly] in :func:`_weak_grad_hook`).
    """

    @staticmethod
    def forward(
        ctx: Any, state: weakref.ref[UnitState], *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        state = ctx.state()
        if state is not None:
            state._on_inputs_grad_ready()
        return (None, *grads)


def _weak_grad_hook(state: UnitState) -> Callable[[torch.Tensor], None]:
    """``state._on_grad_ready``, holding the state weakly.

    [Note: Gradient hooks hold the unit weakly]
    A post-accumulate-grad hook is kept alive by the autograd engine's C++
    side of the unsharded parameter, where Python's cycle collector cannot see
    it. A hook that held the state strongly (a bound method) closed a cycle
    state -> unit -> layout -> unsharded parameter -> hook -> state that
    ``gc`` never collects: the whole module stayed alive after ``del model``.
    So the hook holds the state by a weak reference; the state lives as long
    as its module (module -> state), and a hook that outlives it does nothing.
    """
    ref = weakref.ref(state)

    def on_grad_ready(param: torch.Tensor) -> None:
        live = ref()
        if live is not None:
            live._on_grad_ready(param)

    return on_grad_ready
