"""``fully_shard``: the per-parameter front end (FSDP2's API).

``fully_shard(module)`` shards every parameter of ``module`` that no inner
``fully_shard`` call already manages on dim 0 across the mesh, swaps the
module's class for a subclass of :class:`FSDPModule` and of its own class, and
installs the hooks that gather and free the parameters around its forward
and backward. Apply it bottom-up (blocks first, then the root).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal, NoReturn, TypeVar, cast, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shard_comms import CodecSpec, CustomAllGather, CustomReduceScatter, get_device_handle
from shard_comms.plumbing import default_mesh, post_forward_group, separate_reduce_scatter_group
from shard_core.errors import LayoutError
from shard_core.protocols import EventLike, StreamLike
from shard_runtime._comm_codec import set_comm_codecs
from shard_runtime._compile import eager_hook, mark_managed_modules
from shard_runtime._flat_placement import FlatShard, register_flat_state_dict_hooks
from shard_runtime._framework_check import warn_if_unintegrated
from shard_runtime._front_end import FrontEndRules
from shard_runtime._mesh_groups import MeshGroup, PlacementFn, group_by_mesh
from shard_runtime._module_tree import OwnedParam, owned_params
from shard_runtime._options import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from shard_runtime._param import DataParallelAxes, ShardedParam, resolve_shard_dim
from shard_runtime._per_param_layout import PerParamLayout
from shard_runtime._state import UnitState, get_state, states_in
from shard_runtime._torch_state_view import FSDPStateView, state_view
from shard_runtime._unit import ReshardAfterForward, ShardedState, Unit

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard", "register_fsdp_forward_method"]

_M = TypeVar("_M", bound=nn.Module)

# Set on original and sharded parameters: the label of the unit that sharded
# them, to catch a parameter shared by two units that were not grouped.
_SHARDED_BY_ATTR = "_shard_unit_label"
_FSDP_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}
# FSDP2's rules; see [Note: the root] in _state.py.
FULLY_SHARD_RULES = FrontEndRules(api="fully_shard")


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the gather."""

    def __init__(self, state: UnitState | None) -> None:
        self._state = state

    def wait(self) -> None:
        """Block until the module's parameters are gathered and registered (every unit's)."""
        if self._state is not None:
            for unit in self._state.units:
                unit.wait_for_unshard()
            self._state = None


class FSDPModule:
    """Mixed into the class of every module passed to :func:`fully_shard`.

    ``isinstance(module, FSDPModule)`` tells sharded modules apart; the
    methods below steer the module's unit between steps. The class of a
    sharded module is ``FSDP<Name>``, deriving from this class and its own.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # A new instance of a sharded module's class (``model[1:]`` on a sharded
        # nn.Sequential calls ``type(model)(...)``) has no unit, so it is built as
        # the original class: a plain module holding the (sharded) children.
        orig: Any = _original_class(cls)
        if orig.__new__ is object.__new__:
            self = object.__new__(orig)
        else:
            self = orig.__new__(orig, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def _unit_state(self) -> UnitState:
        state = get_state(_as_module(self))
        assert state is not None
        return state

    def _get_fsdp_state(self) -> FSDPStateView:
        """The state PyTorch's clients reach into; see ``_torch_state_view.py``."""
        return state_view(_as_module(self))

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        # AssertionError, as PyTorch's fully_shard raises here.
        raise AssertionError(
            f"{type(self).__name__} is sharded by fully_shard and cannot be deep-copied "
            "(its parameters are shards bound to a process group); copy the model's state "
            "dict instead: build a new model, then load model.state_dict() into it"
        )

    def reshard(self) -> None:
        """Free the full parameters and register the sharded ones."""
        state = self._unit_state()
        state.land_reductions()  # See [Note: a backward that is not the last] in _state.py.
        for unit in state.units:
            unit.reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather the full parameters; with ``async_op`` return a handle to wait on."""
        state = self._unit_state()
        if state.root is None:
            # Allowed before the root's first forward, on any module, as in PyTorch;
            # the tree is set up by that forward. See [Note: parameters replaced
            # before the first forward] in _state.py.
            state.adopt_replaced_params()
        state.land_reductions()  # See [Note: a backward that is not the last] in _state.py.
        for unit in state.units:  # every unit's gather starts before the first is waited for
            unit.unshard(async_op=True)
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def reset_iter_state(self) -> None:
        """Recover after forward or backward raised, so that the next step runs cleanly.

        Call it on the root (the module whose forward runs first) once the
        exception is caught. It waits for collectives in flight, discards the
        failed step's unreduced gradients and reshards every unit; see
        [Note: recovering from a failed step] in ``_state.py``.

        Raises:
            RuntimeError: called on a sharded module that is not the root.
        """
        self._unit_state().reset_iter_state()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Say whether the next backward is the last one before the optimizer step.

        ``True`` by default; the setting holds until set again, for the whole
        tree (it lives on the root). At the end of a last backward every
        gradient reduction has landed in the sharded gradients. With ``False``
        (micro-batches of gradient accumulation) the end of backward leaves
        the last reductions in flight, so they overlap the next micro-batch's
        forward; they land before their unit's next reduction, at the end of
        the next last backward, or before a state dict, ``reset_iter_state``,
        ``unshard``/``reshard``, ``.to()`` or an optimizer step, never lost or
        counted twice (see [Note: a backward that is not the last] in
        ``_state.py``). ``param.grad`` read directly misses what is in flight:
        read gradients after a backward with ``True``.
        """
        state = self._unit_state()
        (state.root if state.root is not None else state).is_last_backward = is_last_backward

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Reduce gradients in the next backwards (``False``: accumulate full gradients locally)."""
        for state in self._states(recurse):
            for unit in state.units:
                unit.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """On a 2-D mesh, all-reduce across replicas in the next backwards (``False``: defer)."""
        for state in self._states(recurse):
            for unit in state.units:
                unit.requires_all_reduce = requires_all_reduce

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Free full parameters after each unit's backward (``False``: keep them)."""
        for state in self._states(recurse):
            for unit in state.units:
                unit.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free full parameters after each unit's forward (``False``: keep them for backward).

        Applies to the root too (``True`` there frees its parameters after
        every forward, at the cost of an all-gather at the start of backward),
        and replaces an int given to ``fully_shard``.
        """
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"set_reshard_after_forward: reshard_after_forward must be a bool, got "
                f"{reshard_after_forward!r} ({type(reshard_after_forward).__name__}); pass True "
                "or False (a group size to reshard to is only accepted by fully_shard)"
            )
        for unit in (u for state in self._states(recurse) for u in state.units):
            if unit.sharded_state is ShardedState.SHARDED_POST_FORWARD:
                unit.reshard()  # backward then gathers from the full shard group
            unit.reshard_after_forward = reshard_after_forward

    def set_modules_to_forward_prefetch(self, modules: Sequence[FSDPModule]) -> None:
        """Start these modules' all-gathers when this module's forward starts."""
        self._unit_state().forward_prefetch = [
            _state_of(m, "set_modules_to_forward_prefetch") for m in modules
        ]

    def set_modules_to_backward_prefetch(self, modules: Sequence[FSDPModule]) -> None:
        """Start these modules' all-gathers when this module's backward starts."""
        self._unit_state().backward_prefetch = [
            _state_of(m, "set_modules_to_backward_prefetch") for m in modules
        ]

    def set_post_optim_event(self, event: torch.Event) -> None:
        """Make the next all-gather wait for ``event`` (recorded after the optimizer step)."""
        # Stream.wait_event of every device handle also takes the device's own events.
        for unit in self._unit_state().units:
            unit.wait_before_next_gather(cast(EventLike, event))

    # - communication controls; see [Note: Communication controls] in _unit.py

    def set_custom_all_gather(self, comm: CustomAllGather) -> None:
        """Run this unit's all-gathers through ``comm`` instead of shard's own.

        ``comm`` has PyTorch's ``AllGather`` shape: ``allocate(size, *, dtype,
        device)`` returns the output buffer (so it can come from a memory pool
        the user manages) and ``comm(output_tensor=, input_tensor=, group=,
        async_op=)`` gathers into it. It is called for every all-gather of
        this unit (forward and backward, over the post-forward group too) and
        takes precedence over ``set_allocate_memory_from_process_group_for_comm``.
        """
        unit = self._single_unit("set_custom_all_gather")
        unit.check_no_codec("weights", "a custom all-gather", "set_custom_all_gather")
        unit.custom_all_gather = comm

    def set_custom_reduce_scatter(self, comm: CustomReduceScatter) -> None:
        """Run this unit's gradient reduce-scatters through ``comm`` instead of shard's own.

        ``comm`` has PyTorch's ``ReduceScatter`` shape: ``allocate`` gives the
        input and output buffers, ``comm(output_tensor=, input_tensor=,
        group=, op=)`` reduces. shard calls it with ``ReduceOp.SUM`` and
        divides around it (gloo has no pre-multiplied sum), so a comm that
        passes ``op`` on to ``torch.distributed`` averages correctly.
        """
        unit = self._single_unit("set_custom_reduce_scatter")
        unit.check_no_codec("grads", "a custom reduce-scatter", "set_custom_reduce_scatter")
        unit.custom_reduce_scatter = comm

    def set_comm_codec(
        self,
        weights: CodecSpec | None = None,
        grads: CodecSpec | None = None,
        *,
        error_feedback: bool = True,
        recurse: bool = True,
    ) -> None:
        """Encode (quantize) what this module's units send: parameters and/or gradients.

        ``weights`` encodes the all-gathers of the parameters, ``grads`` the
        gradient reduce-scatter (and, on a 2-D mesh, the all-reduce across
        replicas, summed in float32). Each is a codec a plugin registered, by
        name (``"int8"`` or ``"int4"`` from shard-comm-quant), by name with
        options (``("int8", {"block_size": 128})``), or a
        :class:`~shard_core.protocols.CommCodec`; ``None`` sends that traffic in
        its own dtype (the default). Only what crosses the wire changes: the
        sharded parameters, the optimizer, state dicts and checkpoints keep
        full precision, and ``unshard()`` gives the decoded parameters forward
        computes with (as it gives ``param_dtype`` under mixed precision).
        ``error_feedback`` (with ``grads``) adds what each step's encoding lost
        to the next step's gradient, which keeps a float32 residual of what
        the rank sends between steps (``(N - 1) / N`` of each unit's full
        gradient over N ranks; ``shard plan --comm-quant`` counts it). For this module's unit
        and, with ``recurse``, every sharded module below it; call it on the
        root after ``fully_shard`` to encode the whole model. See [Note: Comm
        codecs] in ``_unit.py``.

        Raises:
            UnknownPluginNameError: no plugin registered that name (install
                shard-comm-quant: ``pip install ./plugins/shard-comm-quant``).
            ValueError: a unit has a custom all-gather (with ``weights``) or a
                custom reduce-scatter (with ``grads``); nothing is changed.
            TypeError: ``error_feedback`` is not a bool, or a codec is neither
                a name nor a ``CommCodec``.
        """
        set_comm_codecs(
            [u for state in self._states(recurse) for u in state.units],
            weights,
            grads,
            error_feedback=error_feedback,
            api="set_comm_codec",
        )

    def set_all_reduce_hook(
        self,
        hook: Callable[[torch.Tensor], None],
        *,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Call ``hook(reduce_output)`` on this unit's reduced gradient shard, in place.

        On a 2-D mesh it runs after the replica all-reduce; on a 1-D mesh
        after the reduce-scatter, where a user replicating across their own
        groups all-reduces in it. It sees the averaged shard, or the sum when
        ``set_force_sum_reduction_for_comms(True)`` moved the division after
        it. ``stream`` (accelerators, 1-D meshes only) is where it runs; on
        the CPU streams are no-ops.

        Raises:
            ValueError: ``stream`` given for a unit on a 2-D mesh, whose hook
                runs where shard's all-reduce runs.
        """
        unit = self._single_unit("set_all_reduce_hook")
        if stream is not None and unit.replicate_group is not None:
            raise ValueError(
                f"set_all_reduce_hook({unit.comm_label}): stream cannot be set when using "
                "native HSDP (a 2-D mesh): the hook runs after shard's replica all-reduce, on "
                "its stream; drop stream=, or shard on a 1-D mesh and all-reduce in the hook"
            )
        unit.all_reduce_hook = hook
        if stream is not None:
            unit.all_reduce_hook_stream = cast(StreamLike, stream)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated name of :meth:`set_gradient_divide_factor` (as in PyTorch)."""
        warnings.warn("Use `set_gradient_divide_factor` instead", DeprecationWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's summed gradient by ``factor`` instead of the data-parallel size.

        The data-parallel size is shard x replicate ranks; the sum is taken
        over all of them (reduce-scatter, then the replica all-reduce on a
        2-D mesh) and divided once, before an all-reduce hook sees it. This
        unit only, like PyTorch; call it on each module to change them all.

        Raises:
            ValueError: ``factor`` is not a positive finite number.
        """
        state = self._unit_state()
        unit = state.units[0]
        if isinstance(factor, bool) or not isinstance(factor, int | float):
            raise ValueError(
                f"set_gradient_divide_factor({unit.comm_label}): factor must be a number, got "
                f"{type(factor).__name__}"
            )
        if not 0 < factor < float("inf"):
            raise ValueError(
                f"set_gradient_divide_factor({unit.comm_label}): factor must be a positive "
                f"finite number, got {factor!r}; the world size averages"
            )
        for unit in state.units:
            unit.gradient_divide_factor = float(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Make this unit's collectives pure sums; divide in separate steps after them.

        The gradient is still divided (by the data-parallel size or the
        :meth:`set_gradient_divide_factor` factor), only outside the
        collectives: after the all-reduce hook, and for fp16-like reduce
        dtypes partly before the sum. Backends copy without staging only for
        sums (NCCL's zero-copy collectives). This unit only.
        """
        for unit in self._unit_state().units:
            unit.force_sum_reduction_for_comms = enable

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Reduce zeros for units that got no gradient in a backward (conditional control flow).

        With ``True`` every such unit reduce-scatters at the end of backward, so
        all ranks issue the same collectives and its parameters get zero
        gradients (``False``: their gradients stay ``None``). Parameters without
        a gradient inside a unit that has some are always sent as zeros, so
        ranks that use different parameters of one unit (experts) never
        disagree on a reduce-scatter's size.
        """
        for state in self._states(recurse):
            for unit in state.units:
                unit.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """Let up to ``max_input_buffers`` gradient reductions be in flight at once (default 1).

        Each reduction holds its input buffer until it completes; backward
        waits for the oldest before starting one more. A larger cap keeps
        compute going while slow reductions drain, at the cost of the memory
        of the extra buffers. The root's reductions follow the cap of the
        unit being reduced.

        Raises:
            TypeError: ``max_input_buffers`` is not an int (``bool`` included).
            ValueError: ``max_input_buffers`` is below 1.
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"set_reduce_scatter_max_input_buffers({self._unit_state().label or 'root'}): "
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(
                f"set_reduce_scatter_max_input_buffers({self._unit_state().label or 'root'}): "
                f"max_input_buffers must be a positive int, got {max_input_buffers}; 1 keeps "
                "one reduction in flight"
            )
        for state in self._states(recurse):
            for unit in state.units:
                unit.reduce_scatter_max_input_buffers = max_input_buffers

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Reduce-scatter over a process group of its own, so it overlaps the all-gathers.

        One communicator runs one collective at a time; with a second group
        over the same shard ranks, a unit's reduce-scatter need not wait for
        the next unit's all-gather in backward. The group is created once per
        set of ranks, by those ranks only: call this on every rank of the mesh.
        ``False`` goes back to the shard group.
        """
        for unit in (u for state in self._states(recurse) for u in state.units):
            unit.reduce_scatter_group = (
                separate_reduce_scatter_group(unit.shard_group) if enable else None
            )

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: do not all-gather this unit before its backward (nor prefetch it then).

        For units whose backward needs no parameter values, e.g. an
        embedding (its weight gradient needs only the indices): the gradients
        still arrive and are reduced, and one all-gather per step is saved.
        A unit whose backward does read its parameters then fails in backward.
        This unit only.
        """
        for unit in self._unit_state().units:
            unit.unshard_in_backward = unshard_in_backward

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Take this unit's collective buffers from the process group's own allocator.

        On a GPU with NCCL the all-gather output and the reduce-scatter input
        and output come from memory registered with the communicator, which
        lets NCCL copy without staging (zero-copy over NVLink SHARP or
        InfiniBand). Backends without such an allocator (gloo, so anything on
        the CPU) allocate as usual: nothing changes there.

        Raises:
            AssertionError: a custom all-gather or reduce-scatter is set on this
                unit; those decide their own buffers (as in PyTorch).
        """
        units = self._unit_state().units
        for unit in units:
            _check_no_custom_comm(unit, "set_allocate_memory_from_process_group_for_comm")
        for unit in units:
            unit.comm_allocator = "process_group" if enable else "default"

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """Ask for symmetric-memory buffers for this unit's collectives (NCCL only).

        PyTorch allocates the all-gather's staging buffers from NCCL symmetric
        memory so NCCL can use its copy-engine or symmetric-kernel all-gather.
        shard takes them from the NCCL process group's registered memory (as
        :meth:`set_allocate_memory_from_process_group_for_comm`), which NCCL
        uses for the same zero-copy paths; on the CPU (gloo) nothing changes.

        Raises:
            ValueError: ``backend`` is not ``"NCCL"``.
            AssertionError: a custom all-gather or reduce-scatter is set on this
                unit (as in PyTorch).
        """
        units = self._unit_state().units
        if backend != "NCCL":
            raise ValueError(
                f"set_symm_mem_for_comm({units[0].comm_label}): backend must be 'NCCL', the "
                f"only symmetric-memory backend, got {backend!r}"
            )
        for unit in units:
            _check_no_custom_comm(unit, "set_symm_mem_for_comm")
        for unit in units:
            unit.comm_allocator = "symm_mem"

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Gather on the compute stream (``True``) in pre-forward, pre-backward and prefetch.

        PyTorch's private switch, with its meaning: the units of this module
        and of every sharded module below it issue their all-gathers as an
        ``unshard(async_op=True)`` does, on the current (compute) stream, so
        the gathered buffers are allocated there (no fragmentation between
        streams); the copy-in and the gather then no longer overlap compute,
        so prefetch explicitly (``unshard(async_op=True)``,
        ``set_modules_to_forward_prefetch``) to keep the overlap. Values and
        collectives do not change. See [Note: Communication controls] in
        ``_unit.py``.
        """
        for state in self._states(recurse=True):
            for unit in state.units:
                unit.unshard_async_op = async_op

    def _single_unit(self, method: str) -> Unit:
        """The module's unit, for settings that name one communication group.

        Raises:
            ValueError: the module's parameters are on several meshes (as PyTorch).
        """
        state = self._unit_state()
        if len(state.units) > 1:
            raise ValueError(
                f"{method}({state.label or 'root'}): the module's parameters are on "
                f"{len(state.units)} meshes (ShardPlacementResult in shard_placement_fn), one "
                "unit each; one custom collective or hook cannot serve them all (they "
                "communicate over different process groups): set it on a module whose "
                "parameters share one mesh"
            )
        return state.units[0]

    def _states(self, recurse: bool) -> list[UnitState]:
        if not recurse:
            return [self._unit_state()]
        return states_in([_as_module(self)])

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        return self._unit_state().around_apply(
            lambda: super(FSDPModule, self)._apply(*args, **kwargs)  # type: ignore[misc]
        )


def _original_class(cls: type) -> type:
    """The class ``fully_shard`` derived ``FSDP<Name>`` from (next after FSDPModule in the MRO)."""
    mro = cls.__mro__
    return mro[mro.index(FSDPModule) + 1]


def _check_no_custom_comm(unit: Unit, method: str) -> None:
    custom = unit.custom_all_gather or unit.custom_reduce_scatter
    if custom is not None:
        raise AssertionError(
            f"{method}({unit.comm_label}): cannot be used with the custom communication "
            f"{type(custom).__name__} set by set_custom_all_gather/set_custom_reduce_scatter "
            "(it allocates its own buffers); allocate from the process group in that comm's "
            "allocate() instead"
        )


def _as_module(obj: FSDPModule) -> nn.Module:
    assert isinstance(obj, nn.Module)
    return obj


def _state_of(module: object, method: str) -> UnitState:
    state = get_state(module) if isinstance(module, nn.Module) else None
    if state is None:
        raise ValueError(
            f"{method}: {type(module).__name__} is not sharded; pass modules that fully_shard "
            "was applied to"
        )
    return state


@overload
def fully_shard(
    module: _M,
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: PlacementFn | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
) -> _M: ...


@overload
def fully_shard(
    module: list[nn.Module],
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: PlacementFn | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
) -> list[nn.Module]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: PlacementFn | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 - frozen
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 - frozen
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters on dim 0 across ``mesh`` and hook its forward/backward.

    Args:
        module: the module to shard, or a list of modules sharded as one unit
            (parameters they share, tied weights say, are then gathered once).
        mesh: a 1-D mesh (shard) or a 2-D mesh (replicate, shard) with axis
            names. ``None``: a 1-D mesh over the default process group.
            Parameters that are DTensors on other axes of the same mesh
            (tensor parallelism: ``parallelize_module(block, mesh["tp"], ...)``)
            are sharded again over this mesh; see [Note: sharding a
            tensor-parallel parameter] in ``_param.py``.
        reshard_after_forward: ``True`` frees the full parameters after forward
            and gathers them again for backward; ``False`` keeps them until the
            end of backward (no second all-gather). ``None`` (the default) is
            ``True``, except ``False`` for the root, which backward needs first
            (decided at the first forward; ``set_reshard_after_forward`` overrides).
            An int that divides the shard axis size reshards to groups of that many
            consecutive ranks after forward (each keeps 1/int of the parameters),
            so the backward all-gather stays within the group; the axis size
            itself means ``True``, 1 means ``False``.
        mp_policy: dtypes of compute, reduction and outputs.
        offload_policy: ``CPUOffloadPolicy()`` keeps shards and gradients on the CPU.
        ignored_params: parameters left alone (neither sharded nor reduced).
        shard_placement_fn: called with each parameter; ``Shard(dim)`` shards it
            on ``dim`` (negative counts from the end; the dim must divide evenly
            unless it is 0), ``None`` on dim 0. :func:`flat_shard_placement`
            (it returns ``FlatShard()``) shards on the flattened storage, 1/N
            at any world size; see ``_flat_placement.py``.
            ``ShardPlacementResult(placement, mesh_info)`` (shard's or
            PyTorch's) shards it over a data-parallel mesh of its own (expert
            weights over the expert-data-parallel mesh): the call's parameters
            are grouped by process group, one unit each; see [Note: one unit
            per process group] in ``_mesh_groups.py``.
        dp_mesh_dims: names the data-parallel axes of ``mesh``, which is then
            the whole mesh: every parameter must be a DTensor on it, replicated
            on those axes, and is sharded over ``shard`` (replicated over
            ``replicate``, HSDP).

    Returns:
        ``module`` itself (its class now also derives from :class:`FSDPModule`).
    """
    warn_if_unintegrated("fully_shard", stacklevel=2)
    modules = module if isinstance(module, list) else [module]
    if not modules:
        raise ValueError("fully_shard: got an empty list of modules")
    for m in modules:
        _check_module(m, alone=not isinstance(module, list))
    mesh = mesh if mesh is not None else _default_mesh()
    _check_mesh(mesh, dp_mesh_dims)
    mesh, dp_axes = _data_parallel_mesh(mesh, dp_mesh_dims, reshard_after_forward)
    _resolve_reshard_after_forward(reshard_after_forward, mesh)  # checked before any work
    label = _label(modules)
    managed = {
        id(p) for s in states_in(modules) for u in s.units for p in u.layout.registered_params()
    }
    shared_elsewhere: list[tuple[str, Unit]] = []
    params = _collect_params(modules, managed, ignored_params or set(), label, shared_elsewhere)
    compute_device = _compute_device(mesh)
    # See [Note: one unit per process group] in _mesh_groups.py.
    units = []
    for group in group_by_mesh(params, mesh, shard_placement_fn, label):
        if not group.is_call_mesh and dp_axes is not None:
            raise NotImplementedError(
                f"fully_shard({label}): parameter {group.params[0].fqn!r} has a mesh of its own "
                "(ShardPlacementResult) in a call with dp_mesh_dims; shard it in a call "
                "without dp_mesh_dims"
            )
        sharded = _shard_params(
            group, dp_axes if group.is_call_mesh else None, offload_policy, compute_device
        )
        unit = Unit(
            label=label,
            layout=PerParamLayout(sharded, label, mp_policy=mp_policy),
            mesh=group.mesh,
            mp_policy=mp_policy,
            compute_device=compute_device,
            api=FULLY_SHARD_RULES.api,
            average_per_collective=FULLY_SHARD_RULES.average_per_collective,
            reshard_after_forward=_resolve_reshard_after_forward(reshard_after_forward, group.mesh),
        )
        for (_, param, _), sp in zip(group.params, sharded, strict=True):
            if sp.flat:
                register_flat_state_dict_hooks(sp)
            setattr(param, _SHARDED_BY_ATTR, unit)
            setattr(sp.sharded_param, _SHARDED_BY_ATTR, unit)
        units.append(unit)
    state = UnitState(modules, units, rules=FULLY_SHARD_RULES, mp_policy=mp_policy)
    # See [Note: a weight tied across two calls].
    state.lazy_init_errors.extend(
        functools.partial(_tied_across_calls, label, fqn, other) for fqn, other in shared_elsewhere
    )
    for unit in units:
        unit.reshard()
    mark_managed_modules(modules)  # See [Note: torch.compile] in _compile.py.
    for m in modules:
        if not isinstance(m, FSDPModule):
            m.__class__ = _fsdp_class(type(m))
    return module


# What torch.distributed.pipelining calls: see _torch_state_view.py.
fully_shard.state = state_view  # type: ignore[attr-defined]


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module.<method_name>`` with the same gather/free hooks as ``forward``.

    For methods called instead of ``forward`` (``generate``, say). On a module
    that is not sharded it does nothing, so the same code runs with or without
    ``fully_shard``.
    """
    state = get_state(module) if isinstance(module, FSDPModule) else None
    if state is None:
        return
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(
            f"register_fsdp_forward_method: {type(module).__name__} has no method "
            f"{method_name!r}; pass the name of a method its class defines, e.g. 'generate'"
        )

    # See [Note: torch.compile] in _compile.py.
    pre_forward = eager_hook(state.pre_forward, f"pre-forward of {method_name}")
    post_forward = eager_hook(state.post_forward, f"post-forward of {method_name}")

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = pre_forward(module, args, kwargs)
        return post_forward(module, method(*args, **kwargs))

    setattr(module, method_name, wrapped)


# ---------------------------------------------------------------------- helpers


def _fsdp_class(cls: type[nn.Module]) -> type[nn.Module]:
    fsdp_cls = _FSDP_CLASSES.get(cls)
    if fsdp_cls is None:
        fsdp_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        _FSDP_CLASSES[cls] = fsdp_cls
    return fsdp_cls


def _check_module(module: nn.Module, *, alone: bool) -> None:
    """Refuse what PyTorch's fully_shard refuses, with its exception types."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"fully_shard expects an nn.Module or a list of them, got {type(module).__name__}"
        )
    if (
        alone
        and isinstance(module, (nn.ModuleList, nn.ModuleDict))
        and type(module).forward is nn.Module.forward
    ):
        # Its forward hooks would never run. Other modules without a forward are
        # accepted, as in PyTorch (their children's hooks run).
        raise ValueError(
            f"fully_shard does not support containers that do not implement forward: "
            f"{type(module).__name__} is a container without a forward, so nothing would gather "
            "its parameters; shard its children instead "
            "(fully_shard(child) for each), or pass them as a list to shard them as one "
            "unit (fully_shard(list(container)))"
        )
    if get_state(module) is not None:
        # AssertionError, as PyTorch's fully_shard raises here.
        raise AssertionError(
            f"fully_shard: {type(module).__name__} is already sharded (fully_shard was "
            "applied to it before); apply fully_shard once per module, to inner modules "
            "before outer ones"
        )


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard: torch.distributed is not initialized; call "
            "shard_comms.init_distributed() (or run under torchrun), or pass mesh="
        )
    return default_mesh(get_device_handle().device_type)


def _check_mesh(mesh: DeviceMesh, dp_mesh_dims: DataParallelMeshDims | None = None) -> None:
    if dp_mesh_dims is not None:
        names = mesh.mesh_dim_names
        if names is None:
            raise ValueError(
                f"fully_shard: dp_mesh_dims={dp_mesh_dims} names mesh axes, but the mesh of "
                f"shape {tuple(mesh.shape)} has no axis names; build it with "
                "init_device_mesh(..., mesh_dim_names=(...))"
            )
        for name in (*dp_mesh_dims.shard_names, *dp_mesh_dims.replicate_names):
            if name not in names:
                raise ValueError(
                    f"fully_shard: dp_mesh_dims names the axis {name!r}, but the mesh's axes are "
                    f"{names}; name axes of the mesh passed to fully_shard"
                )
        return
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard: mesh must be 1-D (shard) or 2-D (replicate, shard), got a "
            f"{mesh.ndim}-D mesh of shape {tuple(mesh.shape)}"
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        # AssertionError, as PyTorch's fully_shard raises here.
        raise AssertionError(
            f"fully_shard: a 2-D mesh needs axis names, e.g. init_device_mesh(..., "
            f"{tuple(mesh.shape)}, mesh_dim_names=('replicate', 'shard'))"
        )


def _data_parallel_mesh(
    mesh: DeviceMesh, dims: DataParallelMeshDims | None, reshard_after_forward: object
) -> tuple[DeviceMesh, DataParallelAxes | None]:
    """The mesh the unit communicates over and, with ``dims``, where its axes are in ``mesh``.

    Several names on one side are flattened into one axis, so the unit sees a
    1-D (shard) or 2-D (replicate, shard) mesh either way.
    """
    if dims is None:
        return mesh, None
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"fully_shard: reshard_after_forward={reshard_after_forward} (an int) does not "
            "combine with dp_mesh_dims; pass True or False"
        )
    names = mesh.mesh_dim_names
    assert names is not None  # _check_mesh

    def axis(group: tuple[str, ...]) -> DeviceMesh:
        return mesh[group[0]] if len(group) == 1 else mesh[group]._flatten("_".join(group))

    if not dims.shard_names:
        # Replicate only (DDP): a shard axis of one rank, so each rank keeps whole tensors.
        replicate = axis(dims.replicate_names)
        dp_mesh = replicate._unflatten(
            0, (replicate.size(), 1), ("shard_ddp_replicate", "shard_ddp_shard")
        )
    else:
        dp_mesh = axis(dims.shard_names)
        if dims.replicate_names:
            dp_mesh = DeviceMesh._concatenate([axis(dims.replicate_names), dp_mesh])
    axes = DataParallelAxes(
        spmd_mesh=mesh,
        shard=tuple(names.index(n) for n in dims.shard_names),
        replicate=tuple(names.index(n) for n in dims.replicate_names),
    )
    return dp_mesh, axes


def _resolve_reshard_after_forward(
    value: bool | int | None, mesh: DeviceMesh
) -> ReshardAfterForward:
    """The unit's ``reshard_after_forward`` field for the argument ``value``."""
    if value is None or isinstance(value, bool):
        return value
    shard_size = mesh.size(-1)
    if not isinstance(value, int) or value < 1 or shard_size % value != 0:
        raise ValueError(
            f"fully_shard: reshard_after_forward must be True, False or an int that divides the "
            f"shard axis size {shard_size} (the group size to reshard to after forward), got "
            f"{value!r}"
        )
    if value == shard_size:
        return True
    if value == 1:
        return False
    return post_forward_group(mesh, value)


def _shard_params(
    group: MeshGroup,
    dp_axes: DataParallelAxes | None,
    offload_policy: OffloadPolicy,
    compute_device: torch.device,
) -> list[ShardedParam]:
    """Shard each parameter of ``group`` where its placement and the offload say."""
    offload = type(offload_policy) is not OffloadPolicy
    shard_device = torch.device("cpu") if offload else compute_device
    pin = (
        isinstance(offload_policy, CPUOffloadPolicy)
        and offload_policy.pin_memory
        and compute_device.type != "cpu"
    )
    sharded = []
    for (fqn, param, owners), placement in zip(group.params, group.placements, strict=True):
        flat = isinstance(placement, FlatShard)
        sharded.append(
            ShardedParam.create(
                fqn,
                param,
                owners,
                mesh=group.mesh,
                shard_device=shard_device,
                pin_memory=pin,
                shard_dim=resolve_shard_dim(fqn, param, None if flat else placement),
                dp_axes=dp_axes,
                flat=flat,
            )
        )
    return sharded


def _compute_device(mesh: DeviceMesh) -> torch.device:
    return get_device_handle(mesh.device_type).current_device()


def _label(modules: list[nn.Module]) -> str:
    return ",".join(type(m).__name__ for m in modules)


# [Note: a weight tied across two calls]
# A parameter tied between modules that two fully_shard calls shard (an
# embedding sharded on its own, the output layer that reuses its weight left
# to the root) cannot work: each unit would gather and reduce its own copy.
# PyTorch's fully_shard accepts both calls and raises ValueError at the root's
# first forward, where its tests (and a user's ``try`` around the first step)
# expect it; shard does the same: the second call records the error on its
# state, and the root's lazy init raises the first one in its tree, before
# any collective. (A module shared by two calls is refused at once: its
# parameter is already the other unit's DTensor, PyTorch's TypeError.)


def _collect_params(
    modules: list[nn.Module],
    managed: set[int],
    ignored: set[nn.Parameter],
    label: str,
    shared_elsewhere: list[tuple[str, Unit]],
) -> list[OwnedParam]:
    """Parameters of ``modules`` not managed by an inner unit, with every owner, in order.

    A plain parameter another call already shards (a weight tied across two
    calls) adds its name and that call's unit to ``shared_elsewhere``: refused
    at the first forward (:func:`_tied_across_calls`).
    """
    params = owned_params(
        modules,
        enter=lambda module, prefix: True,  # an inner unit's parameters are in ``managed``
        take=lambda param: id(param) not in managed and param not in ignored,
    )
    for fqn, param, _ in params:
        _check_param(fqn, param, label, modules, shared_elsewhere)
    return params


_ONE_UNIT_FIX = (
    "a parameter shared by two units must be in one unit: pass the modules that share it as a "
    "list to one fully_shard call"
)


def _unit_of(unit: Unit, modules: list[nn.Module]) -> str:
    """``unit`` as an error names it: its module's class and path under ``modules``.

    A unit outside ``modules`` is named by its label (its class, until a
    root's first forward names it by path).
    """
    return next(
        (
            f"{s.class_name} ({name!r})"
            for top in modules
            for name, m in top.named_modules()
            if (s := get_state(m)) is not None and unit in s.units
        ),
        unit.label,
    )


def _tied_across_calls(label: str, fqn: str, other: Unit, root: UnitState) -> ValueError:
    """The root's first-forward error for a parameter ``other``'s call already shards.

    Made then, not at the call, so that a unit outside the call's modules (a
    sibling's) is named by its path under ``root``.
    """
    return ValueError(
        f"fully_shard({label}): parameter {fqn!r} is shared with a parameter already managed "
        f"by another FSDP group, the unit of {_unit_of(other, root.modules)}; {_ONE_UNIT_FIX} "
        "(fully_shard([module_a, module_b]))"
    )


def _check_param(
    fqn: str,
    param: nn.Parameter,
    label: str,
    modules: list[nn.Module],
    shared_elsewhere: list[tuple[str, Unit]],
) -> None:
    other = getattr(param, _SHARDED_BY_ATTR, None)
    if isinstance(other, Unit):
        if isinstance(param, DTensor):
            # A module shared by two calls: its parameter is the other unit's sharded
            # DTensor, which PyTorch refuses with a TypeError.
            raise TypeError(
                f"fully_shard({label}): parameter {fqn!r} is already sharded by the unit of "
                f"{_unit_of(other, modules)}; {_ONE_UNIT_FIX}"
            )
        shared_elsewhere.append((fqn, other))
        return
    # A DTensor parameter not sharded by a unit is split by tensor (or expert)
    # parallelism, or distributed over the whole mesh for dp_mesh_dims; whether
    # its mesh combines with fully_shard's is checked by ShardedParam.create.
    if param.dim() == 0:
        raise LayoutError(
            f"fully_shard({label}): parameter {fqn!r} is a scalar (0-d); sharding splits dim 0, "
            f"so make it 1-D, e.g. nn.Parameter(value.reshape(1))"
        )
    if not param.is_contiguous():
        # NotImplementedError, as PyTorch's fully_shard raises here.
        raise NotImplementedError(
            f"fully_shard({label}): parameter {fqn!r} is not contiguous (stride "
            f"{param.stride()}); make it contiguous first: "
            "module.<name> = nn.Parameter(param.contiguous())"
        )
