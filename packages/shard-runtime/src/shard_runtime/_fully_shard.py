"""``fully_shard``: the composable, per-parameter front end.

``fully_shard(module)`` shards every parameter of ``module`` that no inner
``fully_shard`` call already manages on dim 0 across the mesh, swaps the
module's class for a subclass of :class:`FSDPModule` and of its own class, and
installs the hooks that gather and free the parameters around its forward
and backward. Apply it bottom-up (blocks first, then the root).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar, cast, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from shard_comms import build_mesh, get_device_handle
from shard_core.errors import LayoutError
from shard_core.protocols import EventLike
from shard_runtime._compile import eager_hook, mark_managed_modules
from shard_runtime._options import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from shard_runtime._param import DataParallelAxes, ParamOwner, ShardedParam, resolve_shard_dim
from shard_runtime._per_param import PerParamGroup
from shard_runtime._state import ShardState, get_state, states_in
from shard_runtime._unit import PostForwardGroup, Unit

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard", "register_fsdp_forward_method"]

_M = TypeVar("_M", bound=nn.Module)

# Set on original and sharded parameters: the label of the unit that sharded
# them, to catch a parameter shared by two units that were not grouped.
_SHARDED_BY_ATTR = "_shard_unit_label"
_FSDP_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the gather."""

    def __init__(self, state: ShardState | None) -> None:
        self._state = state

    def wait(self) -> None:
        """Block until the unit's parameters are gathered and registered."""
        if self._state is not None:
            self._state.unit.wait_for_unshard()
            self._state = None


class FSDPModule:
    """Mixed into the class of every module passed to :func:`fully_shard`.

    ``isinstance(module, FSDPModule)`` tells sharded modules apart; the
    methods below steer the module's unit between steps.
    """

    def _shard(self) -> ShardState:
        state = get_state(_as_module(self))
        assert state is not None
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        raise TypeError(
            f"{type(self).__name__} is sharded by fully_shard and cannot be deep-copied "
            "(its parameters are shards bound to a process group); copy the model's state "
            "dict instead: build a new model, then load model.state_dict() into it"
        )

    def reshard(self) -> None:
        """Free the full parameters and register the sharded ones."""
        self._shard().unit.reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather the full parameters; with ``async_op`` return a handle to wait on."""
        state = self._shard()
        if state.root is None:
            state._lazy_init()
        state.unit.unshard(async_op=async_op)
        return UnshardHandle(state) if async_op else None

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Say whether the next backward is the last before the optimizer step.

        Every backward waits for its reductions before returning, so this is
        accepted for compatibility and changes nothing.
        """

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Reduce gradients in the next backwards (``False``: accumulate full gradients locally)."""
        for state in self._states(recurse):
            state.unit.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """On a 2-D mesh, all-reduce across replicas in the next backwards (``False``: defer)."""
        for state in self._states(recurse):
            state.unit.requires_all_reduce = requires_all_reduce

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Free full parameters after each unit's backward (``False``: keep them)."""
        for state in self._states(recurse):
            state.unit.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(
        self, reshard_after_forward: bool, *, recurse: bool = True
    ) -> None:
        """Free full parameters after each unit's forward (``False``: keep them for backward)."""
        for state in self._states(recurse):
            if not state.is_root:
                state.reshard_after_forward = reshard_after_forward

    def set_modules_to_forward_prefetch(self, modules: Sequence[FSDPModule]) -> None:
        """Start these modules' all-gathers when this module's forward starts."""
        self._shard().forward_prefetch = [
            _state_of(m, "set_modules_to_forward_prefetch") for m in modules
        ]

    def set_modules_to_backward_prefetch(self, modules: Sequence[FSDPModule]) -> None:
        """Start these modules' all-gathers when this module's backward starts."""
        self._shard().backward_prefetch = [
            _state_of(m, "set_modules_to_backward_prefetch") for m in modules
        ]

    def set_post_optim_event(self, event: torch.Event) -> None:
        """Make the next all-gather wait for ``event`` (recorded after the optimizer step)."""
        # Stream.wait_event of every device handle also takes the device's own events.
        self._shard().unit._post_event = cast(EventLike, event)

    def _states(self, recurse: bool) -> list[ShardState]:
        if not recurse:
            return [self._shard()]
        return states_in([_as_module(self)])

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        # ``.to()``, ``.float()``, ``to_empty()`` swap new local tensors into the
        # sharded parameters; the unit adopts them afterwards.
        state = self._shard()
        state.unit.reshard()
        result = super()._apply(fn, recurse)  # type: ignore[misc]
        state.unit.reset_after_apply()
        return result


def _as_module(obj: FSDPModule) -> nn.Module:
    assert isinstance(obj, nn.Module)
    return obj


def _state_of(module: object, method: str) -> ShardState:
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
    reshard_after_forward: bool | int = ...,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = ...,
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
    reshard_after_forward: bool | int = ...,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
) -> list[nn.Module]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int = True,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
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
            end of backward (no second all-gather). The root always keeps them.
            An int that divides the shard axis size reshards to groups of that many
            consecutive ranks after forward (each keeps 1/int of the parameters),
            so the backward all-gather stays within the group; the axis size
            itself means ``True``, 1 means ``False``.
        mp_policy: dtypes of compute, reduction and outputs.
        offload_policy: ``CPUOffloadPolicy()`` keeps shards and gradients on the CPU.
        ignored_params: parameters left alone (neither sharded nor reduced).
        shard_placement_fn: called with each parameter; ``Shard(dim)`` shards it
            on ``dim`` (negative counts from the end; the dim must divide evenly
            unless it is 0), ``None`` on dim 0.
        dp_mesh_dims: names the data-parallel axes of ``mesh``, which is then
            the whole mesh: every parameter must be a DTensor on it, replicated
            on those axes, and is sharded over ``shard`` (replicated over
            ``replicate``, HSDP).

    Returns:
        ``module`` itself (its class now also derives from :class:`FSDPModule`).
    """
    modules = module if isinstance(module, list) else [module]
    if not modules:
        raise ValueError("fully_shard: got an empty list of modules")
    for m in modules:
        _check_has_forward(m)
    mesh = mesh if mesh is not None else _default_mesh()
    _check_mesh(mesh, dp_mesh_dims)
    mesh, dp_axes = _data_parallel_mesh(mesh, dp_mesh_dims, reshard_after_forward)
    keep_after_forward, post_forward_size = _resolve_reshard_after_forward(
        reshard_after_forward, mesh
    )
    compute_device = _compute_device(mesh)
    shard_device = (
        torch.device("cpu") if type(offload_policy) is not OffloadPolicy else compute_device
    )
    children = states_in(modules)
    managed = {id(p) for s in children for p in s.unit.group.registered_params()}
    label = _label(modules)
    params = _collect_params(modules, managed, ignored_params or set(), label)
    pin = (
        isinstance(offload_policy, CPUOffloadPolicy)
        and offload_policy.pin_memory
        and compute_device.type != "cpu"
    )
    sharded = [
        ShardedParam.create(
            fqn,
            param,
            owners,
            mesh=mesh,
            shard_device=shard_device,
            pin_memory=pin,
            shard_dim=resolve_shard_dim(
                fqn, param, None if shard_placement_fn is None else shard_placement_fn(param)
            ),
            dp_axes=dp_axes,
        )
        for fqn, param, owners in params
    ]
    unit = Unit(
        label=label,
        group=PerParamGroup(sharded, label),
        mesh=mesh,
        mp_policy=mp_policy,
        compute_device=compute_device,
        post_forward=(
            None if post_forward_size is None else _post_forward_group(mesh, post_forward_size)
        ),
    )
    for (_, param, _), sp in zip(params, sharded, strict=True):
        setattr(param, _SHARDED_BY_ATTR, unit)
        setattr(sp.sharded_param, _SHARDED_BY_ATTR, unit)
    state = ShardState(
        modules,
        unit,
        reshard_after_forward=not keep_after_forward,
        mp_policy=mp_policy,
    )
    for child in children:
        if child.parent is None:
            child.parent = state
    state.name_inner_units()
    unit.reshard()
    mark_managed_modules(modules)  # See [Note: torch.compile] in _compile.py.
    for m in modules:
        cls = type(m)
        if not isinstance(m, FSDPModule):
            m.__class__ = _fsdp_class(cls)
    return module


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module.<method_name>`` with the same gather/free hooks as ``forward``.

    For methods called instead of ``forward`` (``generate``, say).
    """
    state = get_state(module)
    if state is None:
        raise ValueError(
            f"register_fsdp_forward_method: {type(module).__name__} is not sharded; "
            "call fully_shard on it first"
        )
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(
            f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}"
        )

    # See [Note: torch.compile] in _compile.py.
    pre_forward = eager_hook(state.pre_forward, f"pre-forward of {method_name}")
    post_forward = eager_hook(state.post_forward, f"post-forward of {method_name}")

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


def _check_has_forward(module: nn.Module) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"fully_shard expects an nn.Module or a list of them, got {type(module).__name__}"
        )
    if type(module).forward is nn.Module.forward:
        raise ValueError(
            f"fully_shard: {type(module).__name__} has no forward (a container such as "
            "ModuleList or ModuleDict); shard its children instead, or pass them as a list "
            "to shard them as one unit"
        )


_DEFAULT_MESHES: dict[tuple[str, int], DeviceMesh] = {}


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard: torch.distributed is not initialized; call "
            "shard_comms.init_distributed() (or run under torchrun), or pass mesh="
        )
    key = (get_device_handle().device_type, dist.get_world_size())
    mesh = _DEFAULT_MESHES.get(key)
    if mesh is None:
        mesh = _DEFAULT_MESHES[key] = build_mesh(device_type=key[0])
    return mesh


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
    if not dims.shard_names:
        raise NotImplementedError(
            f"fully_shard: dp_mesh_dims={dims} only replicates (DDP); name a shard axis too "
            "(DataParallelMeshDims(shard=...))"
        )
    names = mesh.mesh_dim_names
    assert names is not None  # _check_mesh

    def axis(group: tuple[str, ...]) -> DeviceMesh:
        return mesh[group[0]] if len(group) == 1 else mesh[group]._flatten("_".join(group))

    shard = axis(dims.shard_names)
    dp_mesh = shard
    if dims.replicate_names:
        dp_mesh = DeviceMesh._concatenate([axis(dims.replicate_names), shard])
    axes = DataParallelAxes(
        spmd_mesh=mesh,
        shard=tuple(names.index(n) for n in dims.shard_names),
        replicate=tuple(names.index(n) for n in dims.replicate_names),
    )
    return dp_mesh, axes


def _resolve_reshard_after_forward(value: bool | int, mesh: DeviceMesh) -> tuple[bool, int | None]:
    """(whether full parameters are kept after forward, size of the post-forward group)."""
    if isinstance(value, bool):
        return not value, None
    shard_size = mesh.size(-1)
    if not isinstance(value, int) or value < 1 or shard_size % value != 0:
        raise ValueError(
            f"fully_shard: reshard_after_forward must be True, False or an int that divides the "
            f"shard axis size {shard_size} (the group size to reshard to after forward), got "
            f"{value!r}"
        )
    if value == shard_size:
        return False, None
    if value == 1:
        return True, None
    return False, value


_POST_FORWARD_GROUPS: dict[tuple[tuple[int, ...], ...], list[dist.ProcessGroup]] = {}


def _post_forward_group(mesh: DeviceMesh, size: int) -> PostForwardGroup:
    """This rank's group of ``size`` consecutive ranks along the mesh's shard axis."""
    shard_world = mesh.size(-1)
    rows = mesh.mesh.reshape(-1, shard_world).tolist()
    layout = tuple(tuple(row[i : i + size]) for row in rows for i in range(0, shard_world, size))
    groups = _POST_FORWARD_GROUPS.get(layout)
    if groups is None:
        # Every rank creates every group, in the same order (new_group is collective).
        groups = [dist.new_group(list(ranks)) for ranks in layout]
        _POST_FORWARD_GROUPS[layout] = groups
    rank = dist.get_rank()
    for ranks, group in zip(layout, groups, strict=True):
        if rank in ranks:
            return PostForwardGroup(
                group=group, size=size, index=ranks.index(rank), rows=shard_world // size
            )
    raise ValueError(f"fully_shard: rank {rank} is not in the mesh {mesh}")


def _compute_device(mesh: DeviceMesh) -> torch.device:
    return get_device_handle(mesh.device_type).current_device()


def _label(modules: list[nn.Module]) -> str:
    return ",".join(type(m).__name__ for m in modules)


def _collect_params(
    modules: list[nn.Module],
    managed: set[int],
    ignored: set[nn.Parameter],
    label: str,
) -> list[tuple[str, nn.Parameter, list[ParamOwner]]]:
    """Parameters of ``modules`` not managed by an inner unit, with every owner, in order."""
    found: dict[int, tuple[str, nn.Parameter, list[ParamOwner]]] = {}
    for index, top in enumerate(modules):
        prefix = f"{index}." if len(modules) > 1 else ""
        for mod_name, mod in top.named_modules(remove_duplicate=False):
            for name, param in list(mod._parameters.items()):
                if param is None or id(param) in managed or param in ignored:
                    continue
                fqn = f"{prefix}{mod_name}.{name}" if mod_name else f"{prefix}{name}"
                entry = found.get(id(param))
                if entry is None:
                    _check_param(fqn, param, label, modules)
                    entry = (fqn, param, [])
                    found[id(param)] = entry
                owner = ParamOwner(mod, name)
                if owner not in entry[2]:
                    entry[2].append(owner)
    return list(found.values())


def _check_param(fqn: str, param: nn.Parameter, label: str, modules: list[nn.Module]) -> None:
    other = getattr(param, _SHARDED_BY_ATTR, None)
    if isinstance(other, Unit):
        where = next(
            (
                f"{s.class_name} ({name!r})"
                for top in modules
                for name, m in top.named_modules()
                if (s := get_state(m)) is not None and s.unit is other
            ),
            other.label,
        )
        raise ValueError(
            f"fully_shard({label}): parameter {fqn!r} is already sharded by the unit of "
            f"{where}; a parameter shared by two units must be in one unit: pass the modules "
            "that share it as a list to one fully_shard call"
        )
    # A DTensor parameter not sharded by a unit is split by tensor (or expert)
    # parallelism, or distributed over the whole mesh for dp_mesh_dims; whether
    # its mesh combines with fully_shard's is checked by ShardedParam.create.
    if param.dim() == 0:
        raise LayoutError(
            f"fully_shard({label}): parameter {fqn!r} is a scalar (0-d); sharding splits dim 0, "
            f"so make it 1-D, e.g. nn.Parameter(value.reshape(1))"
        )
    if not param.is_contiguous():
        raise LayoutError(
            f"fully_shard({label}): parameter {fqn!r} is not contiguous (stride "
            f"{param.stride()}); make it contiguous first: "
            "module.<name> = nn.Parameter(param.contiguous())"
        )
