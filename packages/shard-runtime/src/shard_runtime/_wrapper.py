"""``FullyShardedDataParallel``: the wrapper front end, flat parameters on the shared engine.

Same constructor, defaults and methods as PyTorch's wrapper, so a script
switches by changing its import line. Each wrapper instance is one unit whose
parameters live in one flat buffer (:class:`~shard_runtime._flat_buffer_layout.FlatBufferLayout`);
the hooks, prefetching, root logic and communication are the engine's
(:class:`~shard_runtime._state.UnitState`, :class:`~shard_runtime._unit.Unit`),
shared with ``fully_shard``.

[Note: strategies as meshes]
Every strategy is a mesh of (replicate, shard) axes over the same engine:
FULL_SHARD and SHARD_GRAD_OP shard over all ranks (1-D mesh); NO_SHARD is a
(N, 1) mesh, so the "all-gather" is a local copy and the reduction an
all-reduce across N replicas; the hybrid strategies shard within a group and
all-reduce across groups. SHARD_GRAD_OP and _HYBRID_SHARD_ZERO2 keep full
parameters from forward to backward.

[Note: parameter names]
As in PyTorch, ``named_parameters()``/``named_buffers()`` of a wrapper give
the raw module-tree names, ``_fsdp_wrapped_module.`` segments included, with
each flat parameter under ``<wrapper>._fsdp_wrapped_module._flat_param``
(where PyTorch registers it; ours hangs on the wrapper itself). Inside
``summon_full_params`` the summoned wrappers answer without the segments, and
each summoned unit's flat parameter steps aside for the original parameters,
registered in their modules as ``nn.Parameter`` views of the gathered buffer:
users read, edit and write them back by their unwrapped names. State dicts
always use the unwrapped names.

[Note: two kinds of comm hook]
``register_comm_hook(state, hook)`` takes PyTorch's hooks and shard's. A
PyTorch hook owns its ``state`` (a ``DefaultState`` with the process group and
divide factors) and is called ``hook(state, grad)`` for unsharded units and
``hook(state, grad, output)`` for sharded ones; a shard hook receives shard's
reducer instead. PyTorch requires a state, shard's form does not, so a
non-``None`` state that is not shard's reducer means PyTorch's kind.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shard_comms import CodecSpec, DefaultGradReducer, resolve_comm_hook
from shard_comms.plumbing import (
    group_mesh,
    hybrid_mesh,
    node_mesh,
    replicated_mesh,
    standalone_group_mesh,
)
from shard_core.protocols import WrapDecision, WrapPolicy
from shard_runtime._all_gather_extension import is_tensor_subclass
from shard_runtime._clip import clip_grad_norm
from shard_runtime._comm_codec import set_comm_codecs
from shard_runtime._flat_buffer_layout import FlatBufferLayout, FlatParamSpec
from shard_runtime._framework_check import warn_if_unintegrated
from shard_runtime._front_end import BackwardPrefetchMode, FrontEndRules
from shard_runtime._module_tree import owned_params
from shard_runtime._options import MixedPrecisionPolicy
from shard_runtime._state import UnitState, get_state, states_in
from shard_runtime._state_dict_type import (
    StateDictSettings,
    StateDictType,
)
from shard_runtime._summon import FLAT_PARAM, SummonMethods, summon
from shard_runtime._unit import TrainingState as UnitTrainingState
from shard_runtime._unit import Unit
from shard_runtime._unit_layout import check_one_dtype
from shard_runtime._wrap_policy import plan_units, resolve_wrap_policy
from shard_runtime._wrapper_init import (
    materialize_module,
    move_to_device,
    requested_device,
    resolve_ignored,
)
from shard_runtime._wrapper_init import (
    sync_module_states as broadcast_module_states,
)
from shard_runtime._wrapper_names import WRAPPED, WRAPPED_PREFIX, clean_fqn
from shard_runtime._wrapper_optim import OptimStateDictMethods
from shard_runtime._wrapper_options import (
    HYBRID_STRATEGIES,
    RESHARD_AFTER_FORWARD,
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
)
from shard_runtime._wrapper_state_dict import StateDictMethods
from shard_runtime._wrapper_training_state import TrainingState, check_state, wrapper_state
from shard_runtime._wrapper_unit_view import record_buffer_dtype, set_flat_layout

__all__ = ["FullyShardedDataParallel"]

_BACKWARD_PREFETCH: dict[BackwardPrefetch | None, BackwardPrefetchMode] = {
    BackwardPrefetch.BACKWARD_PRE: "pre",
    BackwardPrefetch.BACKWARD_POST: "post",
    None: "none",
}


class _Shared:
    """What every wrapper of one model shares: decided once by the outermost constructor."""

    def __init__(
        self,
        mesh: DeviceMesh,
        process_group: dist.ProcessGroup,
        compute_device: torch.device,
        ignored_modules: frozenset[nn.Module],
        ignored_params: frozenset[nn.Parameter],
    ) -> None:
        self.mesh = mesh
        self.process_group = process_group  # the group PyTorch's wrapper names process_group
        self.compute_device = compute_device
        self.ignored_modules = ignored_modules
        self.ignored_params = ignored_params


class FullyShardedDataParallel(OptimStateDictMethods, StateDictMethods, SummonMethods, nn.Module):
    """Shard ``module``'s parameters as flat buffers across ranks; PyTorch's wrapper API.

    Args mirror ``torch.distributed.fsdp.FullyShardedDataParallel``:
        module: the module to wrap.
        process_group: the group to shard over; for hybrid strategies a
            ``(shard_group, replicate_group)`` tuple. ``None``: the default group.
        sharding_strategy: see :class:`ShardingStrategy`. ``None``: FULL_SHARD.
        cpu_offload: ``CPUOffload(offload_params=True)`` keeps shards on the CPU.
        auto_wrap_policy: which submodules become units of their own: a
            ``WrapPolicy``, a registered name (``"transformer"``), ``(name,
            options)``, a set of module classes, or PyTorch's callable form.
        backward_prefetch: when the next unit's all-gather starts in backward.
        mixed_precision: see :class:`MixedPrecision`.
        ignored_modules: modules kept whole (never sharded, never reduced).
        param_init_fn: initialises modules built on the meta device.
        device_id: the compute device (an index or a device).
        sync_module_states: broadcast rank 0's parameters and buffers first.
        forward_prefetch: start the next unit's all-gather when a unit's
            forward starts (in the previous iteration's order).
        limit_all_gathers: at most two units' all-gathers in flight.
        use_orig_params: keep the original parameters visible (views of the
            flat buffer) instead of one flat parameter per unit.
        ignored_states: parameters or modules to ignore (instead of ``ignored_modules``).
        device_mesh: a 1-D mesh, or a 2-D (replicate, shard) mesh for hybrid sharding.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup
        | tuple[dist.ProcessGroup, dist.ProcessGroup]
        | None = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Any = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None = None,
        device_mesh: DeviceMesh | None = None,
        *,
        _shared: _Shared | None = None,
    ) -> None:
        super().__init__()
        if _shared is None:
            warn_if_unintegrated("FullyShardedDataParallel", stacklevel=2)
        strategy = sharding_strategy or ShardingStrategy.FULL_SHARD
        if not isinstance(strategy, ShardingStrategy):
            raise TypeError(
                f"FullyShardedDataParallel: sharding_strategy must be a ShardingStrategy, "
                f"got {strategy!r}"
            )
        _check_not_sharded(module)
        if auto_wrap_policy is not None and _shared is None:
            _check_no_wrapper_inside(module)
        # PyTorch warns about a frozen mix only in the units its auto-wrap policy makes.
        self._made_by_policy = _shared is not None
        if _shared is None:
            _shared = _prepare(
                module,
                process_group=process_group,
                strategy=strategy,
                device_mesh=device_mesh,
                auto_wrap=auto_wrap_policy is not None,
                ignored_modules=ignored_modules,
                ignored_states=ignored_states,
                param_init_fn=param_init_fn,
                device_id=device_id,
                sync=sync_module_states,
            )
        self._shared = _shared
        # PyTorch's attributes: the shard group (the one within a node for hybrid strategies).
        self.process_group = _shared.process_group
        self.rank = _shared.process_group.rank()
        self.world_size = _shared.process_group.size()
        self.sharding_strategy = strategy
        self.mixed_precision = mixed_precision
        self.cpu_offload = cpu_offload or CPUOffload()
        self.use_orig_params = use_orig_params
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.limit_all_gathers = limit_all_gathers
        if auto_wrap_policy is not None:
            options = {
                "process_group": process_group,
                "sharding_strategy": strategy,
                "cpu_offload": cpu_offload,
                "backward_prefetch": backward_prefetch,
                "mixed_precision": mixed_precision,
                "forward_prefetch": forward_prefetch,
                "limit_all_gathers": limit_all_gathers,
                "use_orig_params": use_orig_params,
            }
            _auto_wrap(module, auto_wrap_policy, mixed_precision, options, _shared)
        self._fsdp_wrapped_module = module
        self._state_dict_settings = StateDictSettings.of(StateDictType.FULL_STATE_DICT)
        self._in_summon = False  # inside summon_full_params; see [Note: parameter names]
        self._init_unit()

    # ------------------------------------------------------------------ construction

    def _init_unit(self) -> None:
        shared = self._shared
        mesh = shared.mesh
        module = self._fsdp_wrapped_module
        _check_same_use_orig_params(self, module)
        specs = _collect_specs(module, shared.ignored_modules, shared.ignored_params)
        _check_frozen_mix(
            specs, self.use_orig_params, type(module).__name__, warn=self._made_by_policy
        )
        _check_plain_tensors(specs, type(module).__name__)
        check_one_dtype(
            f"FullyShardedDataParallel({type(module).__name__})",
            [(spec.fqn, spec.param.dtype) for spec in specs],
            "cast them to one dtype (module.to(dtype)) or wrap the differently typed submodule "
            "as its own unit (an auto_wrap_policy)",
        )
        shard_rank = mesh.get_local_rank(mesh.ndim - 1)
        shard_device = (
            torch.device("cpu") if self.cpu_offload.offload_params else shared.compute_device
        )
        mp = self.mixed_precision
        layout = FlatBufferLayout(
            specs,
            rank=shard_rank,
            world=mesh.size(-1),
            shard_device=shard_device,
            use_orig_params=self.use_orig_params,
            keep_low_precision_grads=bool(mp and mp.keep_low_precision_grads),
            compute_dtype=mp.param_dtype if mp else None,
        )
        if layout.flat_param is not None:
            self.register_parameter(FLAT_PARAM, layout.flat_param)
        policy = MixedPrecisionPolicy(
            param_dtype=mp.param_dtype if mp else None,
            reduce_dtype=(mp.reduce_dtype or mp.param_dtype) if mp else None,
            cast_forward_inputs=bool(mp and mp.cast_forward_inputs),
        )
        if mp is not None and mp.buffer_dtype is not None:
            _cast_buffers(module, mp.buffer_dtype, shared.ignored_modules)
        # FSDP1's rules; see [Note: the root] in _state.py.
        rules = FrontEndRules(
            api="FullyShardedDataParallel",
            early_forward_is_error=True,
            root_keeps_params_for_backward=True,
            clean_name=clean_fqn,
            backward_prefetch=_BACKWARD_PREFETCH[self.backward_prefetch],
            forward_prefetch=self.forward_prefetch,
            limit_all_gathers=self.limit_all_gathers,
            cast_root_inputs=bool(mp and mp.cast_root_forward_inputs),
            average_per_collective=False,
        )
        unit = Unit(
            label=type(module).__name__,
            layout=layout,
            mesh=mesh,
            mp_policy=policy,
            compute_device=shared.compute_device,
            api=rules.api,
            average_per_collective=rules.average_per_collective,
            reshard_after_forward=self.sharding_strategy in RESHARD_AFTER_FORWARD,
        )
        state = UnitState([self], [unit], rules=rules, mp_policy=policy)
        set_flat_layout(state, layout)
        unit.reshard()
        self._install_state_dict_hooks()
        _WRAPPED_MODULES.add(module)

    # ------------------------------------------------------------------ module surface

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        wrapped = self._modules[WRAPPED]
        assert wrapped is not None
        return wrapped

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules[WRAPPED], name)

    def __getitem__(self, key: int) -> Any:
        return self.module.__getitem__(key)  # type: ignore[operator]

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """PyTorch's names: wrapper segments included, except inside ``summon_full_params``.

        See [Note: parameter names].
        """
        flat = {id(w._parameters.get(FLAT_PARAM)) for w in self.fsdp_modules(self)}
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            if id(param) in flat:
                name = name[: -len(FLAT_PARAM)] + f"{WRAPPED}.{FLAT_PARAM}"
            yield (name.replace(WRAPPED_PREFIX, "") if self._in_summon else name), param

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """PyTorch's names: wrapper segments included, except inside ``summon_full_params``."""
        for name, buffer in super().named_buffers(prefix, recurse, remove_duplicate):
            yield (name.replace(WRAPPED_PREFIX, "") if self._in_summon else name), buffer

    @property
    def training_state(self) -> TrainingState:
        """``IDLE``, ``FORWARD_BACKWARD`` or ``SUMMON_FULL_PARAMS``, as PyTorch's wrapper says.

        See [Note: a thin _assert_state] in ``_wrapper_training_state.py``.
        """
        return wrapper_state(_state(self).unit.training_state, self._in_summon)

    def _assert_state(self, state: object) -> None:
        """Raise ``ValueError`` unless the wrapper is in ``state`` (one, or a list).

        PyTorch's private method, kept because PyTorch's shared FSDP1 test
        helpers call it; it accepts PyTorch's ``TrainingState`` members. See
        [Note: a thin _assert_state] in ``_wrapper_training_state.py``.
        """
        check_state(self.training_state, state, f"the wrapper around {type(self.module).__name__}")

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        return _state(self).around_apply(
            lambda: super(FullyShardedDataParallel, self)._apply(fn, recurse)  # type: ignore[no-untyped-call]
        )

    # ------------------------------------------------------------------ training controls

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) inside the block; root only."""
        state = _state(self)
        if state.parent is not None:
            raise RuntimeError(
                "FullyShardedDataParallel.no_sync() must be called on the root wrapper, "
                f"not on the inner one around {type(self.module).__name__}"
            )
        states = states_in([self])
        saved = [s.unit.requires_gradient_sync for s in states]
        for s in states:
            s.unit.requires_gradient_sync = False
        try:
            yield
        finally:
            for s, value in zip(states, saved, strict=True):
                s.unit.requires_gradient_sync = value

    def register_comm_hook(
        self, state: object, hook: Callable[..., Any] | str | None = None
    ) -> None:
        """Replace the gradient reduction of every unit in this tree.

        Two kinds of hook, told apart by ``state`` (see [Note: two kinds of comm hook]):

        - PyTorch's: ``register_comm_hook(state, hook)`` with a ``state`` object
          of the hook's own (``DefaultState(process_group)``,
          ``LowPrecisionState(process_group)``) and a hook such as
          ``default_hooks.bf16_compress_hook``, called as PyTorch calls it:
          ``hook(state, grad)`` for NO_SHARD, ``hook(state, grad, output)``
          otherwise, the hook dividing as it sees fit. Root only, once, not
          with hybrid strategies (``AssertionError``, as in PyTorch).
        - shard's: a :class:`~shard_core.protocols.CommHook` or a registered
          name (``"bf16_compress"``), passed alone or as ``(None, hook)``; it
          receives shard's reducer.
        """
        if _is_torch_comm_hook(state, hook):
            self._register_torch_comm_hook(state, hook)
            return
        chosen = hook if hook is not None else state
        resolved = None
        if chosen is not None and (isinstance(chosen, str) or callable(chosen)):
            resolved = resolve_comm_hook(chosen)
        if resolved is None:
            raise TypeError(
                f"register_comm_hook: expected a comm hook or a registered hook name, got "
                f"{type(chosen).__name__}"
            )
        for s in states_in([self]):
            if s.root is not None and s.unit.training_state is not UnitTrainingState.IDLE:
                raise RuntimeError("register_comm_hook: call it before training starts")
            s.unit.check_no_codec("grads", "a comm hook", "register_comm_hook")
        for s in states_in([self]):
            s.unit.comm_hook = resolved

    def set_comm_codec(
        self,
        weights: CodecSpec | None = None,
        grads: CodecSpec | None = None,
        *,
        error_feedback: bool = True,
        recurse: bool = True,
    ) -> None:
        """Encode (quantize) what this wrapper's units send: parameters and/or gradients.

        shard's addition, the same as ``FSDPModule.set_comm_codec``: ``weights``
        encodes the all-gathers of the flat parameters, ``grads`` the gradient
        reduction (reduce-scatter, and the all-reduce across replicas of the
        hybrid and ``NO_SHARD`` strategies, summed in float32); each a
        registered codec name (``"int8"``, ``"int4"`` from shard-comm-quant), a
        ``(name, options)`` pair or a :class:`~shard_core.protocols.CommCodec`,
        ``None`` for full precision. ``summon_full_params``, state dicts and
        checkpoints keep full precision. ``error_feedback`` carries what each
        step's encoding lost into the next step's gradient. For this wrapper
        and, with ``recurse``, every wrapper inside it. Not with a comm hook
        (``ValueError``): both replace the reduction.
        """
        states = states_in([self]) if recurse else [_state(self)]
        set_comm_codecs(
            [s.unit for s in states],
            weights,
            grads,
            error_feedback=error_feedback,
            api="FullyShardedDataParallel.set_comm_codec",
        )

    def _register_torch_comm_hook(self, state: object, hook: object) -> None:
        if not self.check_is_root():
            raise AssertionError(
                f"register_comm_hook: the wrapper around {type(self.module).__name__} is inside "
                "another wrapper; register the hook on the outermost (root) wrapper, which "
                "installs it on every unit"
            )
        if not callable(hook):
            raise ValueError(
                f"register_comm_hook: hook {hook!r} ({type(hook).__name__}) is not callable; pass "
                "a function hook(state, grad, output=None), e.g. default_hooks.allreduce_hook"
            )
        for wrapper in self.fsdp_modules(self):
            if wrapper.sharding_strategy in HYBRID_STRATEGIES:
                raise AssertionError(
                    f"register_comm_hook: a (state, hook) comm hook cannot run under "
                    f"{wrapper.sharding_strategy.name} (the wrapper around "
                    f"{type(wrapper.module).__name__}): it reduces over one group only; use "
                    "FULL_SHARD, SHARD_GRAD_OP or NO_SHARD, or a shard CommHook"
                )
            if _state(wrapper).unit.comm_hook is not None:
                raise AssertionError(
                    f"register_comm_hook: the wrapper around {type(wrapper.module).__name__} "
                    "already has a comm hook; register one hook per model, once, before training"
                )
            _state(wrapper).unit.check_no_codec("grads", "a comm hook", "register_comm_hook")
        for wrapper in self.fsdp_modules(self):
            unit = _state(wrapper).unit
            # NO_SHARD, or any strategy on one rank (PyTorch then switches to NO_SHARD).
            unit.comm_hook = _TorchCommHook(state, hook, unsharded=unit.shard_world == 1)

    def check_is_root(self) -> bool:
        """Whether this wrapper is the root: the outermost wrapper of its model.

        Decided when the wrappers are built (an outer wrapper adopts the ones
        inside it), so the answer is the same before and after the first
        forward. PyTorch decides it lazily, so there, before the first forward,
        asking an inner wrapper first makes that one a root.
        """
        return _state(self).parent is None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of every parameter in this tree to a global norm; return it.

        Root only (a ``RuntimeError`` on an inner wrapper, as in PyTorch), between steps.
        """
        if not self.check_is_root():
            raise RuntimeError(
                "`clip_grad_norm_()` should only be called on the root FSDP instance: the "
                f"wrapper around {type(self.module).__name__} is inside another wrapper; call it "
                "on the outermost wrapper, which clips the gradients of every unit together"
            )
        self._assert_state(TrainingState.IDLE)
        return clip_grad_norm(self, float(max_norm), float(norm_type))

    # ------------------------------------------------------------------ static helpers

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """Every wrapper in ``module``'s tree (only the outermost ones with ``root_only``)."""
        found = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if not root_only:
            return found
        inner = {id(m) for w in found for m in w.module.modules() if m is not w}
        return [m for m in found if id(m) not in inner]

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``nn.Module.apply`` on full parameters (gathered, then written back).

        As in PyTorch, each wrapper gathers only its own unit: ``fn`` runs
        once per module, inner wrappers gathering theirs when ``apply``
        reaches them. Only between steps and outside ``summon_full_params``
        (else ``ValueError``, as PyTorch's "expected to be in states").
        """
        self._assert_state(TrainingState.IDLE)
        with summon(self, False, True, False, False, False):
            super().apply(fn)
        return self


# ---------------------------------------------------------------------- construction helpers


def _prepare(
    module: nn.Module,
    *,
    process_group: dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup] | None,
    strategy: ShardingStrategy,
    device_mesh: DeviceMesh | None,
    auto_wrap: bool,
    ignored_modules: Iterable[nn.Module] | None,
    ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None,
    param_init_fn: Callable[[nn.Module], None] | None,
    device_id: int | torch.device | None,
    sync: bool,
) -> _Shared:
    """What the outermost wrapper decides once for the whole model."""
    modules, params = resolve_ignored(module, ignored_modules, ignored_states)
    device = requested_device(device_id)
    materialize_module(module, param_init_fn, device, modules)
    compute_device = move_to_device(module, device_id, params)
    mesh = _mesh_for(strategy, process_group, device_mesh, auto_wrap, compute_device.type)
    if sync:
        axes = range(mesh.ndim - 1, -1, -1)
        for axis in axes:
            broadcast_module_states(
                module,
                mesh.get_group(axis),
                params,
                ignored_modules=modules,
                # One model check over the whole mesh, before the first broadcast.
                fingerprint_groups=[mesh.get_group(a) for a in axes] if axis == axes[0] else [],
            )
    return _Shared(
        mesh, _named_group(strategy, process_group, mesh), compute_device, modules, params
    )


def _named_group(
    strategy: ShardingStrategy,
    process_group: dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup] | None,
    mesh: DeviceMesh,
) -> dist.ProcessGroup:
    """The group PyTorch's wrapper calls ``process_group``: the one it shards over.

    For NO_SHARD that is every rank (the group given, or the world), though
    shard's mesh puts each rank in a shard group of its own (see [Note:
    strategies as meshes]); for the hybrid strategies the shard group.
    """
    if isinstance(process_group, tuple):
        return process_group[0]
    if strategy is ShardingStrategy.NO_SHARD:
        return mesh.get_group(0)
    return mesh.get_group(mesh.ndim - 1)


def _mesh_for(
    strategy: ShardingStrategy,
    process_group: dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup] | None,
    device_mesh: DeviceMesh | None,
    auto_wrap: bool,
    device_type: str,
) -> DeviceMesh:
    """See [Note: strategies as meshes]."""
    if device_mesh is not None and process_group is not None:
        raise ValueError(
            "FullyShardedDataParallel: pass either process_group or device_mesh, not both"
        )
    if device_mesh is None and not dist.is_initialized() and not isinstance(process_group, tuple):
        if process_group is not None and (
            strategy not in HYBRID_STRATEGIES
            and (strategy is not ShardingStrategy.NO_SHARD or process_group.size() == 1)
        ):
            # See [Note: a mesh without a default group] in shard_comms/_groups.py.
            return standalone_group_mesh(process_group, device_type=device_type)
        raise RuntimeError(
            "FullyShardedDataParallel: torch.distributed is not initialized; call "
            "shard_comms.init_distributed() (or run under torchrun) before wrapping, or pass "
            "device_mesh= or process_group="
        )
    hybrid = strategy in HYBRID_STRATEGIES
    if device_mesh is not None:
        if hybrid and device_mesh.ndim != 2:
            raise ValueError(
                f"FullyShardedDataParallel: {strategy.name} needs a 2-D (replicate, shard) "
                f"device_mesh, got a {device_mesh.ndim}-D one"
            )
        if not hybrid and device_mesh.ndim != 1:
            raise ValueError(
                f"FullyShardedDataParallel: {strategy.name} needs a 1-D device_mesh, got a "
                f"{device_mesh.ndim}-D one; use HYBRID_SHARD for 2-D meshes"
            )
        if strategy is ShardingStrategy.NO_SHARD:
            return replicated_mesh(device_mesh.get_group())
        return device_mesh
    if hybrid:
        if isinstance(process_group, tuple):
            shard_group, replicate_group = process_group
            return hybrid_mesh(shard_group, replicate_group, device_type=device_type)
        if process_group is not None:
            raise ValueError(
                f"FullyShardedDataParallel: {strategy.name} takes process_group as a "
                "(shard_group, replicate_group) tuple, or a 2-D device_mesh"
            )
        if not auto_wrap:
            raise ValueError(
                f"FullyShardedDataParallel: manual wrapping with {strategy.name} needs an explicit "
                "process_group=(shard_group, replicate_group) or a 2-D device_mesh; with an "
                "auto_wrap_policy the groups are built per node from LOCAL_WORLD_SIZE"
            )
        node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        return node_mesh(node, device_type=device_type)
    if isinstance(process_group, tuple):
        raise ValueError(
            f"FullyShardedDataParallel: a (shard_group, replicate_group) tuple needs a hybrid "
            f"strategy, got {strategy.name}"
        )
    group = process_group if process_group is not None else dist.group.WORLD
    assert group is not None
    if strategy is ShardingStrategy.NO_SHARD:
        return replicated_mesh(group)
    return group_mesh(group, device_type=device_type)


def _auto_wrap(
    module: nn.Module,
    policy: Any,
    mixed_precision: MixedPrecision | None,
    options: dict[str, Any],
    shared: _Shared,
) -> None:
    """Wrap the units ``policy`` chooses, bottom-up, in place of the modules in their parents."""
    resolved = resolve_wrap_policy(policy)
    if mixed_precision is not None and mixed_precision._module_classes_to_ignore:
        resolved = _NoMixedPrecisionFor(resolved, tuple(mixed_precision._module_classes_to_ignore))
    targets = plan_units(
        module,
        resolved,
        ignored_modules=shared.ignored_modules,
        ignored_params=shared.ignored_params,
    )
    for target in targets:
        if target.module is module:
            continue
        parent_name, _, child_name = target.name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        wrapper = FullyShardedDataParallel(
            target.module, **{**options, **target.overrides}, _shared=shared
        )
        parent._modules[child_name] = wrapper


class _NoMixedPrecisionFor:
    """A policy that also makes modules of ``classes`` units without mixed precision."""

    def __init__(self, base: WrapPolicy | None, classes: tuple[type[nn.Module], ...]) -> None:
        self._base = base
        self._classes = classes

    def descend(self, module: nn.Module, name: str) -> bool:
        return True if self._base is None else self._base.descend(module, name)

    def wrap(self, module: nn.Module, name: str, unwrapped_numel: int) -> WrapDecision:
        if isinstance(module, self._classes) and name:
            return {"mixed_precision": None}
        return False if self._base is None else self._base.wrap(module, name, unwrapped_numel)


def _collect_specs(
    module: nn.Module,
    ignored_modules: frozenset[nn.Module],
    ignored_params: frozenset[nn.Parameter],
) -> list[FlatParamSpec]:
    """The parameters this wrapper flattens: not ignored, not inside an inner wrapper."""

    def enter(mod: nn.Module, prefix: str) -> bool:
        if mod in ignored_modules or isinstance(mod, FullyShardedDataParallel):
            return False
        if get_state(mod) is not None:
            raise ValueError(
                f"FullyShardedDataParallel: submodule {prefix[:-1]!r} ({type(mod).__name__}) "
                "is already sharded by fully_shard; shard a model with one front end, "
                "fully_shard or FullyShardedDataParallel"
            )
        return True

    params = owned_params([module], enter=enter, take=lambda p: p not in ignored_params)
    return [FlatParamSpec(fqn, param, owners) for fqn, param, owners in params]


def _check_plain_tensors(specs: list[FlatParamSpec], module_name: str) -> None:
    """Refuse tensor-subclass parameters: one flat buffer holds plain elements only.

    A subclass (torchao's NF4 or float8 weights) keeps its own data layout and
    all-gathers through ``fsdp_pre_all_gather``, which only ``fully_shard``'s
    per-parameter layout honours (PyTorch's FSDP1 flattens and loses it).
    """
    for spec in specs:
        if is_tensor_subclass(spec.param):
            kind = type(spec.param.detach()).__name__
            raise TypeError(
                f"FullyShardedDataParallel({module_name}): parameter {spec.fqn!r} is a "
                f"{kind}, a tensor subclass; the wrapper's flat buffer holds "
                "plain tensors only. Shard this module with fully_shard, which keeps the "
                "subclass and its fsdp_pre_all_gather/fsdp_post_all_gather hooks"
            )


def _check_same_use_orig_params(outer: FullyShardedDataParallel, module: nn.Module) -> None:
    """One ``use_orig_params`` per model, as PyTorch requires (a ``ValueError`` there too).

    The optimizer and state-dict code treat a whole model's units one way:
    flat parameters or the originals. PyTorch finds a mix at the root's lazy
    init; it is found here when the outer wrapper is built, before any
    parameter moves.
    """
    for name, inner in module.named_modules():
        if (
            isinstance(inner, FullyShardedDataParallel)
            and inner.use_orig_params != outer.use_orig_params
        ):
            raise ValueError(
                f"FullyShardedDataParallel: use_orig_params must be the same for every wrapper "
                f"of a model; the wrapper of {type(module).__name__} has "
                f"use_orig_params={outer.use_orig_params} but the one of "
                f"{type(inner.module).__name__} ({clean_fqn(name)!r}) has "
                f"use_orig_params={inner.use_orig_params}; pass the same use_orig_params to "
                "every FullyShardedDataParallel(...) call"
            )


def _check_frozen_mix(
    specs: list[FlatParamSpec], use_orig_params: bool, name: str, *, warn: bool
) -> None:
    frozen = [s.fqn for s in specs if not s.param.requires_grad]
    trainable = [s.fqn for s in specs if s.param.requires_grad]
    if not frozen or not trainable:
        return
    if not use_orig_params:
        raise ValueError(
            f"FullyShardedDataParallel({name}): one flat parameter cannot mix frozen and "
            f"trainable parameters with use_orig_params=False ({name} has both parameters with "
            f"requires_grad=True and False); frozen: {', '.join(frozen)}; "
            f"trainable: {', '.join(trainable)}. Wrap them in separate units (an "
            "auto_wrap_policy), or pass use_orig_params=True"
        )
    if not warn:
        return
    warnings.warn(
        f"FullyShardedDataParallel({name}): frozen and trainable parameters share a unit, so "
        f"gradient memory is spent on the frozen ones too ({', '.join(frozen)}); wrap them "
        "separately to avoid it",
        UserWarning,
        stacklevel=4,
    )


def _cast_buffers(module: nn.Module, dtype: torch.dtype, ignored: frozenset[nn.Module]) -> None:
    """Cast floating buffers to ``dtype``, remembering each one's dtype for state dicts."""
    for mod in module.modules():
        if mod in ignored or isinstance(mod, FullyShardedDataParallel):
            continue
        for name, buffer in mod._buffers.items():
            if buffer is not None and torch.is_floating_point(buffer):
                record_buffer_dtype(mod, name, buffer.dtype)
                mod._buffers[name] = buffer.to(dtype)


_WRAPPED_MODULES: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Every module some wrapper wraps, so that wrapping one twice fails."""


def _check_not_sharded(module: nn.Module) -> None:
    name = type(module).__name__
    if isinstance(module, FullyShardedDataParallel):
        raise ValueError(
            f"FullyShardedDataParallel: the module is already a FullyShardedDataParallel "
            f"(around {type(module.module).__name__}); wrap each module once"
        )
    if module in _WRAPPED_MODULES:
        raise ValueError(
            f"FullyShardedDataParallel: this {name} is already wrapped by a "
            "FullyShardedDataParallel (it is that wrapper's .module); wrap each module once "
            "and use the wrapper"
        )
    if get_state(module) is not None:
        raise ValueError(
            f"FullyShardedDataParallel: this {name} is already sharded by fully_shard; "
            "shard a model with one front end, fully_shard or FullyShardedDataParallel"
        )


def _check_no_wrapper_inside(module: nn.Module) -> None:
    """Refuse an ``auto_wrap_policy`` over a model that already holds sharded submodules.

    PyTorch refuses it with a ``ValueError`` too (its test matches the words
    "FSDP auto wrapping requires modules to not already have FSDP applied
    but found <name> in"): the policy would decide units around ones made by
    hand, and the two plans rarely agree.
    """
    for name, inner in module.named_modules():
        if inner is module or get_state(inner) is None:
            continue
        kind = (
            "a FullyShardedDataParallel"
            if isinstance(inner, FullyShardedDataParallel)
            else "sharded by fully_shard"
        )
        raise ValueError(
            f"FullyShardedDataParallel: FSDP auto wrapping requires modules to not already have "
            f"FSDP applied but found {clean_fqn(name)} in {type(module).__name__} ({kind}); "
            "wrap by hand or with auto_wrap_policy, not both: pass auto_wrap_policy=None to keep "
            "the wrappers already made, or apply the policy to the unwrapped model"
        )


def _is_torch_comm_hook(state: object, hook: object) -> bool:
    """Whether ``register_comm_hook(state, hook)`` is PyTorch's form.

    See [Note: two kinds of comm hook].
    """
    return (
        hook is not None
        and not isinstance(hook, str)
        and state is not None
        and not isinstance(state, DefaultGradReducer)
    )


class _TorchCommHook:
    """PyTorch's ``hook(state, grad[, output])`` behind shard's ``CommHook`` protocol.

    The hook does the whole reduction with its own state (its process group
    and divide factors); shard's reducer is not used. For NO_SHARD units
    PyTorch passes the gradient alone and the hook reduces it in place; the
    result is then copied into ``output``, the tensor the engine accumulates.
    """

    __slots__ = ("hook", "state", "unsharded")

    def __init__(self, state: object, hook: Callable[..., Any], *, unsharded: bool) -> None:
        self.state = state
        self.hook = hook
        self.unsharded = unsharded

    def __call__(self, reducer: object, grad: torch.Tensor, output: torch.Tensor | None) -> None:
        if self.unsharded or output is None:
            self.hook(self.state, grad)
            if output is not None:
                output.copy_(grad)
            return
        # The hook may swap ``output.data`` (a low-precision hook compresses and
        # decompresses it); the engine reads this same tensor object afterwards.
        self.hook(self.state, grad, output)

    def __repr__(self) -> str:
        return f"TorchCommHook({getattr(self.hook, '__name__', self.hook)!r})"


def _state(wrapper: FullyShardedDataParallel) -> UnitState:
    state = get_state(wrapper)
    assert state is not None
    return state
