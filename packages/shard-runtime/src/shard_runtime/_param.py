"""One parameter's life under per-parameter sharding.

A :class:`ShardedParam` owns both faces of one original parameter:

- the *sharded* face, registered on the module between steps: an
  ``nn.Parameter`` holding a ``DTensor`` whose local tensor is
  ``torch.chunk(data, n, dim=shard_dim)[rank]``, where ``data`` is the
  parameter (or, for a parameter already split by tensor parallelism, its
  local tensor) and ``n`` the size of the mesh's shard axis. ``shard_dim`` is
  0 unless ``shard_placement_fn`` says otherwise. Its data lives in a padded
  buffer of ``ceil(size / n)`` slices along ``shard_dim`` so every rank
  contributes the same number of bytes to an all-gather; the local tensor is a
  view of its first slices, so the optimizer's in-place updates land directly
  in what the next all-gather sends.
- the *unsharded* face, registered while the unit computes: a leaf
  ``nn.Parameter`` of ``data``'s shape (in the compute dtype), a view of a
  padded buffer of ``n * ceil(size / n)`` slices. For a tensor-parallel
  parameter it is a ``DTensor`` with the tensor-parallel mesh and placements
  it had before ``fully_shard``. Its storage is released when the unit
  reshards and re-grown before the next all-gather writes into it, so the
  ``Parameter`` object autograd saw stays the same across the step.

[Note: version counters]
Writing the all-gathered data into the unsharded parameter is an in-place
operation on a tensor that autograd may have saved during forward. The write
restores the exact values autograd saved, so it is hidden from autograd's
version check; anything else would make every backward after a reshard fail.

[Note: sharding a tensor-parallel parameter]
A parameter that ``parallelize_module`` already split over a "tp" axis is a
DTensor on the tp mesh. ``fully_shard(mesh=mesh["dp"])`` shards its *local*
tensor again over the data-parallel axis, so the collectives only ever move
local tensors over the dp group (gradients reduce over dp only) and the
compute face is the original tp DTensor. The sharded face is one DTensor on
the mesh (dp axes first, then the tp axes) whose placements compose both:
``Shard(d)`` on the dp axis followed by the tp placements. When tp already
shards the same dim ``d`` over ``k`` ranks, the dp piece is a piece *of each
tp piece*, not a contiguous block of the full tensor: DTensor spells that
``_StridedShard(d, split_factor=k)``. With ``dp_mesh_dims`` the parameter is
a DTensor on the whole mesh, replicated on its data-parallel axes; the
sharded face replaces those axes' ``Replicate()`` by the same dp placement.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from shard_comms.plumbing import joined_mesh
from shard_core import contiguous_stride, dim0_chunk_range, padded_dim0_size
from shard_runtime._all_gather_extension import (
    AllGatherExtension,
    extension_of,
    is_tensor_subclass,
)
from shard_runtime._dtensor import contiguous_dtensor
from shard_runtime._flat_placement import is_flat_layout
from shard_runtime._storage import alloc_storage, free_storage

__all__ = [
    "DataParallelAxes",
    "ParamOwner",
    "ShardedParam",
    "resolve_shard_dim",
]


@dataclass(frozen=True, slots=True)
class ParamOwner:
    """A (module, attribute) pair a parameter is registered under (tied weights have several)."""

    module: nn.Module
    name: str


@dataclass(frozen=True, slots=True)
class DataParallelAxes:
    """The data-parallel axes of a whole mesh, from ``fully_shard(..., dp_mesh_dims=...)``.

    Attributes:
        spmd_mesh: the mesh every parameter is a DTensor on.
        shard: indices of the axes the parameters are sharded over (flattened
            into one shard axis when several).
        replicate: indices of the axes the shards are replicated over (HSDP);
            empty for plain FSDP.
    """

    spmd_mesh: DeviceMesh
    shard: tuple[int, ...]
    replicate: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _Placement:
    """Where a parameter's shards live: mesh and placements of both faces (not a unit layout)."""

    data: torch.Tensor  # ND: the tensor to shard (the parameter, or its tp local tensor)
    sharded_mesh: DeviceMesh
    sharded_placements: tuple[Placement, ...]
    unsharded_spec: DTensorSpec | None  # the compute face's DTensor spec; None: a plain tensor
    dp_axes: frozenset[int]  # axes of the unsharded spec that are data parallel (spmd mesh)


@dataclass(eq=False, slots=True)
class ShardedParam:
    """Sharded and unsharded faces of one parameter; see the module docstring."""

    fqn: str  # qualified name in the outermost sharded module known so far
    local_name: str  # qualified name in the module(s) of its own unit
    owners: list[ParamOwner]
    full_shape: torch.Size  # the parameter's global shape (the sharded DTensor's shape)
    data_shape: torch.Size  # what the unit gathers: full_shape, or the tp local tensor's shape
    # - sharding ("rows" are slices along shard_dim)
    mesh: DeviceMesh  # the data-parallel mesh the unit communicates over
    dtensor_mesh: DeviceMesh  # the sharded DTensor's mesh: mesh, or the mesh with tp axes
    placements: tuple[Placement, ...]  # the sharded DTensor's placements
    shard_dim: int
    shard_rank: int
    shard_world: int
    padded_rows: int  # ceil(split_shape[shard_dim] / shard_world): rows each rank contributes
    local_rows: int  # rows of the real (unpadded) local shard
    # - sharded face
    padded_shard: torch.Tensor  # ND, padded_shape, sharded dtype
    sharded_param: nn.Parameter  # DTensor parameter, local = first local_rows of padded_shard
    # - unsharded face (compute dtype), storage released while sharded
    unsharded_spec: DTensorSpec | None = None  # tp DTensor spec of the compute face
    dp_axes: frozenset[int] = frozenset()  # data-parallel axes of unsharded_spec's mesh
    flat: bool = False  # sharded on the flattened storage; see [Note: flat shards as 1-D DTensors]
    # the sharded tensor's own all-gather hooks; see [Note: the tensor-subclass all-gather
    # contract] in _all_gather_extension.py
    extension: AllGatherExtension | None = None
    compute_dtype: torch.dtype = torch.float32  # the unsharded face's dtype (init_unsharded)
    # a subclass shard's local tensor as installed in the DTensor, to see ``_apply`` replace it
    installed_local: torch.Tensor | None = None
    unsharded_padded: torch.Tensor = field(init=False)  # ND, padded_rows * shard_world rows
    unsharded_param: nn.Parameter = field(init=False)
    # the requires_grad both faces were given last; see [Note: the face the user sets]
    synced_requires_grad: bool = field(init=False)
    # the gradients of backwards without gradient sync, summed in the reduce dtype; see
    # [Note: gradients kept across backwards without sync] in _per_param_layout.py
    accumulated_grad: torch.Tensor | None = None

    # -------------------------------------------------------------- creation

    @classmethod
    def create(
        cls,
        fqn: str,
        param: nn.Parameter,
        owners: list[ParamOwner],
        *,
        mesh: DeviceMesh,
        shard_device: torch.device,
        pin_memory: bool = False,
        shard_dim: int = 0,
        dp_axes: DataParallelAxes | None = None,
        flat: bool = False,
    ) -> ShardedParam:
        """Shard ``param`` on ``shard_dim`` over the last axis of ``mesh``.

        ``param`` is a plain tensor, or a DTensor split by tensor parallelism
        (or, with ``dp_axes``, a DTensor on the whole mesh); see [Note:
        sharding a tensor-parallel parameter]. ``shard_dim`` must be
        normalized (see :func:`resolve_shard_dim`). ``pin_memory`` pins the
        shard (CPU offload with an accelerator) so its copies to the device
        can run asynchronously. ``flat`` asks for the flat layout (see
        [Note: flat shards as 1-D DTensors] in ``_flat_placement.py``), applied
        where :func:`~shard_runtime._flat_placement.is_flat_layout` says it helps.
        """
        shard_world = mesh.size(-1)
        shard_rank = mesh.get_local_rank(mesh.ndim - 1)
        placed = _placement(fqn, param, mesh, shard_dim, dp_axes)
        data = placed.data
        data_shape = data.shape
        subclass = is_tensor_subclass(data)
        flat = (
            flat
            and not subclass
            and is_flat_layout(
                data_shape, shard_world, tensor_parallel=placed.unsharded_spec is not None
            )
        )
        if flat:
            shard_dim = 0
            placed = replace(placed, sharded_placements=(*placed.sharded_placements[:-1], Shard(0)))
        split_shape = torch.Size((data.numel(),)) if flat else data_shape
        size = split_shape[shard_dim]
        _check_even_split(fqn, data_shape, shard_dim, size, shard_world)
        padded_rows = padded_dim0_size(size, shard_world)
        rows = dim0_chunk_range(size, shard_rank, shard_world)
        if data.device.type == "meta":  # stays on meta until module.to_empty(...)
            shard_device = data.device
        if subclass:
            padded_shard = _padded_subclass_shard(
                data.detach(), shard_dim, shard_world, shard_rank, padded_rows, shard_device
            )
        else:
            padded_shard = _padded_shard(
                data.detach().reshape(split_shape),
                shard_dim,
                rows,
                padded_rows,
                shard_device,
                pin_memory,
            )
        local_rows = len(rows)
        full_shape = param.shape
        sharded_param = _make_sharded_param(
            padded_shard.narrow(shard_dim, 0, local_rows),
            placed.sharded_mesh,
            placed.sharded_placements,
            split_shape if flat else full_shape,
            param.requires_grad,
        )
        self = cls(
            fqn=fqn,
            local_name=fqn,
            owners=owners,
            full_shape=full_shape,
            data_shape=data_shape,
            mesh=mesh,
            dtensor_mesh=placed.sharded_mesh,
            placements=placed.sharded_placements,
            shard_dim=shard_dim,
            shard_rank=shard_rank,
            shard_world=shard_world,
            padded_rows=padded_rows,
            local_rows=local_rows,
            padded_shard=padded_shard,
            sharded_param=sharded_param,
            unsharded_spec=placed.unsharded_spec,
            dp_axes=placed.dp_axes,
            flat=flat,
            extension=extension_of(fqn, padded_shard) if subclass else None,
            installed_local=sharded_param._local_tensor if subclass else None,  # type: ignore[attr-defined]
        )
        self.init_unsharded(data.dtype, shard_device)
        return self

    def init_unsharded(
        self,
        dtype: torch.dtype,
        device: torch.device,
        storage: torch.UntypedStorage | None = None,
        offset: int = 0,
    ) -> None:
        """(Re)create the unsharded face in ``dtype`` on ``device``, storage released.

        With ``storage`` the padded unsharded buffer lives at element
        ``offset`` of the unit's one unsharded storage, which the unit grows
        and releases for all of its parameters at once (see [Note: one
        unsharded storage per unit] in ``_per_param_layout.py``); it is left
        as it is here. With an all-gather extension the face is built by the
        first gather (``fsdp_post_all_gather``); until then it is an empty
        stand-in of the right dtype and trainability.
        """
        self.compute_dtype = dtype
        if self.extension is not None:
            self.extension.reset()
            self.unsharded_padded = torch.empty(0, dtype=dtype, device=device)
            self.unsharded_param = nn.Parameter(
                torch.empty(0, dtype=dtype, device=device), requires_grad=self.requires_grad
            )
            self.synced_requires_grad = self.requires_grad
            return
        rows = self.padded_rows * self.shard_world
        shape = self.split_shape
        padded_shape = _with_dim(shape, self.shard_dim, rows)
        if storage is None:
            self.unsharded_padded = torch.empty(padded_shape, dtype=dtype, device=device)
        else:
            # Its own tensor on the shared storage, not a view of the unit's buffer: the
            # parameters keep version counters of their own.
            self.unsharded_padded = torch.empty(0, dtype=dtype, device=device).set_(
                storage, offset, padded_shape, contiguous_stride(padded_shape)
            )
        data = self.unsharded_padded.narrow(self.shard_dim, 0, shape[self.shard_dim])
        if self.flat:
            data = data.view(self.data_shape)
        spec = self.unsharded_spec
        if spec is not None:
            meta = spec.tensor_meta
            if meta is not None and meta.dtype != dtype:
                spec = replace(spec, tensor_meta=TensorMeta(meta.shape, meta.stride, dtype))
            data = DTensor(data, spec, requires_grad=False)  # type: ignore[no-untyped-call]
        self.unsharded_param = nn.Parameter(data, requires_grad=self.requires_grad)
        self.synced_requires_grad = self.requires_grad
        if storage is None:
            self.free_unsharded()

    # -------------------------------------------------------------- trainability

    @property
    def requires_grad(self) -> bool:
        """Whether the parameter trains: the flag the user sees (and sets) on the sharded face.

        See [Note: requires_grad is read at every forward] in ``_per_param_layout.py``.
        """
        return self.sharded_param.requires_grad

    def requires_grad_changed(self) -> bool:
        """Whether the user set ``requires_grad`` on either face since the last sync."""
        synced = self.synced_requires_grad
        return self.requires_grad != synced or self.unsharded_param.requires_grad != synced

    def sync_requires_grad(self) -> None:
        """Give both faces the flag the user set last, on whichever face they set it.

        See [Note: the face the user sets]. Both are leaves: always allowed.
        """
        self.adopt_unsharded_requires_grad()
        if self.unsharded_param.requires_grad != self.requires_grad:
            self.unsharded_param.requires_grad_(self.requires_grad)
        self.synced_requires_grad = self.requires_grad

    def adopt_unsharded_requires_grad(self) -> None:
        """Carry a flag set on the unsharded face over to the sharded one, which keeps it.

        [Note: the face the user sets]
        Between a forward that leaves a unit unsharded (``reshard_after_forward=False``,
        the root, an evaluation under ``torch.no_grad()``) and its resharding, the
        module's parameters are the unsharded faces, so ``named_parameters()`` hands
        the user those, and a ``requires_grad_`` lands there. The sharded face is the
        parameter that persists (the optimizer's, the one every later forward reads),
        so a flag that changed on the unsharded face alone since the last sync is
        copied onto it: at the next forward and whenever the unit reshards. PyTorch
        forgets such a flag (its next forward trains a parameter frozen that way, or
        not one unfrozen that way); shard keeps what the user set.
        """
        synced = self.synced_requires_grad
        flag = self.unsharded_param.requires_grad
        if flag != synced and self.requires_grad == synced:
            self.sharded_param.requires_grad_(flag)

    # -------------------------------------------------------------- sizes

    @property
    def split_shape(self) -> torch.Size:
        """The shape that is split over ranks: ``data_shape``, or ``(numel,)`` when flat."""
        return torch.Size((self.data_shape.numel(),)) if self.flat else self.data_shape

    @property
    def dtensor_shape(self) -> torch.Size:
        """The sharded DTensor's global shape: ``full_shape``, or ``(numel,)`` when flat."""
        return self.split_shape if self.flat else self.full_shape

    @property
    def padded_shape(self) -> torch.Size:
        """Shape of one rank's padded shard."""
        return _with_dim(self.split_shape, self.shard_dim, self.padded_rows)

    @property
    def local_shape(self) -> torch.Size:
        """Shape of this rank's real (unpadded) shard: the sharded DTensor's local tensor."""
        return _with_dim(self.split_shape, self.shard_dim, self.local_rows)

    @property
    def padded_numel(self) -> int:
        """Elements one rank contributes to the unit's all-gather for this parameter."""
        return self.padded_shard.numel()

    @property
    def row_numel(self) -> int:
        """Elements in one dim-0 row of the gathered tensor (1 when flat)."""
        return math.prod(self.split_shape[1:])

    # -------------------------------------------------------------- storage

    def alloc_unsharded(self) -> None:
        """Grow the unsharded storage back before the all-gathered data is written."""
        if self.extension is None:  # an extension's outputs grow as they are written
            alloc_storage(self.unsharded_padded)

    def free_unsharded(self) -> None:
        """Release the unsharded storage; the ``Parameter`` object stays for autograd."""
        if self.extension is not None:
            self.extension.free()
        else:
            free_storage(self.unsharded_padded)

    # -------------------------------------------------------------- all-gather extension

    def extension_inputs(self, device: torch.device, mp_policy: object) -> list[torch.Tensor]:
        """What ``fsdp_pre_all_gather`` sends for this parameter (1-D tensors, on ``device``).

        The hook sees the sharded local tensor itself (where, e.g., float8's
        precomputed scale is set), unpadded; a rank whose shard is short must
        return inputs of the padded shard size, as PyTorch requires.
        """
        extension = self.extension
        assert extension is not None
        local = self.sharded_param._local_tensor  # type: ignore[attr-defined]
        padded = self.padded_shape
        if local.device != device:
            local = local.to(device, non_blocking=True)
        module = self.owners[0].module
        mesh = self.mesh if self.mesh.ndim == 1 else _last_axis(self.mesh)
        return extension.pre_all_gather(local, mesh, self.data_shape, module, mp_policy, padded)

    def write_extension_outputs(self, blocks: list[torch.Tensor]) -> bool:
        """Copy the gathered ``(world, n)`` blocks into the outputs and rebuild the parameter.

        ``blocks`` are in the gather's dtype (``uint8`` when it moved bytes).
        Returns whether a new unsharded ``Parameter`` was made (its gradient
        hook must be registered).
        """
        extension = self.extension
        assert extension is not None
        outputs = extension.outputs_for(self.shard_world, blocks[0].device)
        with torch.no_grad():
            for output, block in zip(outputs, blocks, strict=True):
                target = output.view(self.shard_world, -1)
                if block.dtype != target.dtype:
                    target = target.view(block.dtype)
                target.copy_(block)
        full = extension.post_all_gather(
            self.sharded_param._local_tensor,  # type: ignore[attr-defined]
            self.compute_dtype,
            self.unsharded_param,
        )
        if full is None:
            return False
        if full.size() != self.data_shape:  # padded: the real rows lead
            full = torch.as_strided(full, self.data_shape, contiguous_stride(self.data_shape), 0)
        self.unsharded_param = nn.Parameter(full, requires_grad=self.requires_grad)
        self.synced_requires_grad = self.requires_grad
        return True

    def unsharded_rows_view(self) -> torch.Tensor:
        """The padded unsharded buffer as ``(shard_world, padded_numel)``, for copy-out.

        Only for ``shard_dim == 0``: on another dim each rank's block is
        strided (see :meth:`unsharded_blocks`).
        """
        assert self.shard_dim == 0
        return self.unsharded_padded.view(self.shard_world, self.padded_numel)

    def unsharded_blocks(self, tensor: torch.Tensor | None = None) -> torch.Tensor:
        """``tensor`` (default: the padded unsharded buffer) as ``(shard_world, *padded_shape)``.

        A view: rank ``r``'s block is ``[r]``, whichever dim is sharded.
        """
        t = self.unsharded_padded if tensor is None else tensor.contiguous()
        d = self.shard_dim
        split = (
            *self.data_shape[:d],
            self.shard_world,
            self.padded_rows,
            *self.data_shape[d + 1 :],
        )
        return t.view(split).movedim(d, 0)

    def write_gathered(self, blocks: torch.Tensor) -> None:
        """Copy the all-gathered blocks (``(shard_world, padded_numel)``) into the full buffer.

        ``blocks`` may be the same bytes as ``uint8`` (a unit that gathers bytes).
        """
        if blocks.dtype != self.unsharded_padded.dtype:
            if self.shard_dim == 0:
                self.unsharded_rows_view().view(blocks.dtype).copy_(blocks)
                return
            blocks = blocks.contiguous().view(self.unsharded_padded.dtype)
        if self.shard_dim == 0:
            self.unsharded_rows_view().copy_(blocks)
        else:
            self.unsharded_blocks().copy_(blocks.view(self.shard_world, *self.padded_shape))

    def read_gathered(self, ranks: slice, out: torch.Tensor) -> None:
        """Copy the unsharded blocks of ``ranks`` into ``out`` (``(len, padded_numel)``).

        ``out`` may be ``uint8``: the blocks' bytes are copied, not converted.
        """
        if self.extension is not None:
            raise NotImplementedError(
                f"fully_shard: parameter {self.fqn!r} is a {type(self.padded_shard).__name__} "
                "gathered by its own fsdp_pre_all_gather; resharding it to a smaller group "
                "after forward (reshard_after_forward=<int>) is not supported: use True or False"
            )
        if self.shard_dim == 0:
            rows = self.unsharded_rows_view()[ranks]
        else:
            rows = self.unsharded_blocks()[ranks].contiguous().view(out.shape[0], -1)
        out.copy_(rows.view(out.dtype) if out.dtype != rows.dtype else rows)

    def write_back_own_rows(self) -> bool:
        """Copy this rank's rows of the unsharded face, which the user wrote, into the shard.

        Only where the face holds the shard's own values: same dtype, no
        tensor-parallel face, no subclass of its own. Elsewhere the write
        cannot be carried exactly: ``False``, with a warning that it holds
        until the unit reshards.
        """
        if (
            self.extension is not None
            or self.unsharded_spec is not None
            or self.compute_dtype != self.padded_shard.dtype
        ):
            warnings.warn(
                f"fully_shard: parameter {self.fqn!r} was written in place while unsharded "
                f"(between forwards that kept it gathered); its {self._face_kind()} cannot be "
                "carried to the shard exactly, so the write holds only until the module "
                "reshards (after its next backward). Write the sharded parameter instead: "
                "call reshard() on the module first.",
                stacklevel=2,
            )
            return False
        with torch.no_grad():
            if self.shard_dim == 0:
                own = self.unsharded_rows_view()[self.shard_rank]
                self.padded_shard.view(-1).copy_(own)
            else:
                self.padded_shard.copy_(self.unsharded_blocks()[self.shard_rank])
        return True

    def _face_kind(self) -> str:
        if self.extension is not None:
            return f"{type(self.padded_shard).__name__} shard"
        if self.unsharded_spec is not None:
            return "tensor-parallel face"
        return (
            f"{str(self.compute_dtype).removeprefix('torch.')} face (the shard is "
            f"{str(self.padded_shard.dtype).removeprefix('torch.')})"
        )

    def unsharded_grad(self) -> torch.Tensor | None:
        """The unsharded gradient as a plain tensor of ``data_shape`` (``None``: no gradient).

        A tensor-parallel gradient is first brought to the parameter's own
        placements on the non-data-parallel axes (a ``Partial`` tp gradient is
        reduced over tp here; data-parallel axes are left to the reduction).
        """
        grad = self.accumulated_grad
        if grad is None:
            grad = self.unsharded_param.grad
        if grad is None or not isinstance(grad, DTensor):
            return grad
        spec = self.unsharded_spec
        assert spec is not None
        target = tuple(
            have if axis in self.dp_axes else want
            for axis, (have, want) in enumerate(zip(grad.placements, spec.placements, strict=True))
        )
        if tuple(grad.placements) != target:
            grad = grad.redistribute(placements=target)
        local = grad.to_local()
        assert isinstance(local, torch.Tensor)
        return local

    def fold_grad(self) -> None:
        """Add the last backward's gradient to those kept from earlier backwards, if any."""
        grad = self.unsharded_param.grad
        if self.accumulated_grad is not None and grad is not None:
            self.accumulated_grad += grad
            self.unsharded_param.grad = None

    def keep_grad(self, dtype: torch.dtype | None) -> None:
        """Keep the full gradient for the next backward, in ``dtype`` (``None``: as computed)."""
        self.fold_grad()
        grad = self.unsharded_param.grad
        if dtype is None or grad is None or grad.dtype == dtype:
            return
        self.unsharded_param.grad = None
        self.accumulated_grad = grad.to(dtype)

    def drop_unsharded_grads(self) -> None:
        """Forget the full gradient and any kept from earlier backwards."""
        self.unsharded_param.grad = None
        self.accumulated_grad = None

    def shard_versions(self) -> tuple[int, int]:
        """The version counters of the sharded parameter and of the local shard it wraps.

        An optimizer's in-place update counts on the DTensor; a write through
        ``to_local()`` on the local tensor only (one through ``.data`` on neither).
        """
        local: torch.Tensor = self.sharded_param._local_tensor  # type: ignore[attr-defined]
        return (self.sharded_param._version, local._version)

    def version_tensors(self) -> list[torch.Tensor]:
        """The unsharded tensors whose version counters a gather write must preserve."""
        if self.extension is not None:
            # The outputs are rewritten in place each gather, and the full tensor the hook
            # built may be a view of them (a plain tensor autograd saved).
            built = [self.unsharded_param] if self.extension.built else []
            return [*self.extension.outputs, *built]
        param = self.unsharded_param
        if isinstance(param, DTensor):
            local = param.to_local()
            assert isinstance(local, torch.Tensor)
            return [param, local]
        return [param]

    # -------------------------------------------------------------- registration

    def to_sharded(self) -> None:
        """Register the sharded DTensor parameter on every owner (it keeps the user's flag)."""
        self.adopt_unsharded_requires_grad()
        for owner in self.owners:
            owner.module._parameters[owner.name] = self.sharded_param

    def to_unsharded(self) -> None:
        """Register the unsharded parameter on every owner."""
        for owner in self.owners:
            owner.module._parameters[owner.name] = self.unsharded_param

    def reset_sharded_param(self) -> None:
        """Re-adopt the sharded parameter's local tensor after ``module._apply``.

        ``model.to(...)``, ``to_empty(...)`` and friends swap a new local tensor
        into the DTensor parameter; copy it into a fresh padded buffer (in its
        new dtype and device) and point the DTensor at a view of that buffer.
        A tensor subclass is padded with its own ops (``new_zeros``, ``copy_``)
        and kept as it is when already of the padded size, so it stays that
        subclass (an NF4 weight loaded after meta-device init stays NF4).
        """
        local = self.sharded_param._local_tensor  # type: ignore[attr-defined]
        assert isinstance(local, torch.Tensor)
        if is_tensor_subclass(local) or is_tensor_subclass(self.padded_shard):
            self._reset_subclass_shard(local)
            return
        if (
            local.dtype == self.padded_shard.dtype
            and local.device == self.padded_shard.device
            and local.data_ptr() == self.padded_shard.data_ptr()
        ):
            return
        padded = torch.zeros(self.padded_shape, dtype=local.dtype, device=local.device)
        view = padded.narrow(self.shard_dim, 0, self.local_rows)
        if local.device.type != "meta":
            with torch.no_grad():
                view.copy_(local)
        self.padded_shard = padded
        self.sharded_param._local_tensor = view  # type: ignore[attr-defined]

    def _reset_subclass_shard(self, local: torch.Tensor) -> None:
        if local is self.installed_local:
            return
        if local.size() == self.padded_shape:
            padded = view = local
        else:
            padded = _pad_subclass(local, self.padded_shape, self.shard_dim)
            view = padded.narrow(self.shard_dim, 0, self.local_rows)
            self.sharded_param._local_tensor = view  # type: ignore[attr-defined]
        self.padded_shard = padded
        self.installed_local = view
        self.extension = extension_of(self.fqn, view) if is_tensor_subclass(view) else None

    # -------------------------------------------------------------- gradients

    def accumulate_sharded_grad(self, local_grad: torch.Tensor) -> None:
        """Add ``local_grad`` (the reduced local shard's gradient) to the sharded parameter."""
        local_grad = local_grad.to(device=self.padded_shard.device, dtype=self.padded_shard.dtype)
        grad = self.sharded_param.grad
        if grad is None:
            spec = getattr(self.sharded_param, "_spec", None)
            if spec is not None and spec.tensor_meta is not None:
                # The parameter's own spec describes its gradient exactly; building the
                # DTensor from it skips from_local's work: 2.7 us instead of 24 us per
                # parameter per step, measured here (64x64, CPU).
                self.sharded_param.grad = DTensor(  # type: ignore[no-untyped-call]
                    local_grad, spec, requires_grad=False
                )
            else:
                self.sharded_param.grad = contiguous_dtensor(
                    local_grad, self.dtensor_mesh, self.placements, self.dtensor_shape
                )
        else:
            grad_local = grad.to_local()  # type: ignore[attr-defined]
            assert isinstance(grad_local, torch.Tensor)
            grad_local.add_(local_grad)


def resolve_shard_dim(fqn: str, param: nn.Parameter, placement: object) -> int:
    """The normalized dim a ``shard_placement_fn`` result (``Shard`` or ``None``) shards on."""
    if placement is None:
        return 0
    if type(placement) is not Shard:
        raise ValueError(
            f"fully_shard: shard_placement_fn returned {placement!r} for parameter {fqn!r}; "
            "return Shard(dim) to shard it on dim, None for the default Shard(0), or "
            "ShardPlacementResult(placement, mesh_info) to shard it over a mesh of its own"
        )
    ndim = param.dim()
    dim = placement.dim + ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < ndim:
        raise AssertionError(
            f"fully_shard: shard_placement_fn returned {placement!r} for parameter {fqn!r} of "
            f"shape {tuple(param.shape)}, but it has {ndim} dims; return Shard(d) with "
            f"-{ndim} <= d < {ndim}"
        )
    return dim


def _placement(
    fqn: str,
    param: nn.Parameter,
    mesh: DeviceMesh,
    dim: int,
    dp_axes: DataParallelAxes | None,
) -> _Placement:
    """Both faces' meshes and placements; see [Note: sharding a tensor-parallel parameter]."""
    dp = (Replicate(),) * (mesh.ndim - 1)
    if dp_axes is not None:
        return _spmd_placement(fqn, param, mesh, dim, dp_axes)
    if not isinstance(param, DTensor):
        return _Placement(param, mesh, (*dp, Shard(dim)), None, frozenset())
    spec = param._spec
    if len(spec.placements) > 2:
        raise NotImplementedError(
            f"fully_shard: parameter {fqn!r} is a DTensor placed {spec.placements} on "
            f"{spec.mesh}; only 1-D tensor (or expert) parallelism, or 2-D, composes with "
            "fully_shard"
        )
    try:
        sharded_mesh = joined_mesh(mesh, spec.mesh)
    except RuntimeError as exc:
        raise RuntimeError(
            f"fully_shard: parameter {fqn!r} is a DTensor on {spec.mesh}, which cannot be "
            f"combined with the data-parallel mesh {mesh} ({exc}); cut both from one mesh, "
            "e.g. mesh['tp'] for parallelize_module and mesh['dp'] for fully_shard"
        ) from exc
    split = spec.num_shards_map[dim]
    placement: Placement = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
    local = param.to_local()
    assert isinstance(local, torch.Tensor)
    return _Placement(local, sharded_mesh, (*dp, placement, *spec.placements), spec, frozenset())


def _spmd_placement(
    fqn: str,
    param: nn.Parameter,
    mesh: DeviceMesh,
    dim: int,
    dp_axes: DataParallelAxes,
) -> _Placement:
    """Layout of a DTensor on the whole mesh, replicated on its data-parallel axes."""
    spmd_mesh = dp_axes.spmd_mesh
    if not isinstance(param, DTensor):
        raise ValueError(
            f"fully_shard: with dp_mesh_dims, parameter {fqn!r} must be a DTensor on the mesh "
            f"passed to fully_shard, got a plain tensor; distribute it first (e.g. with "
            "distribute_module or parallelize_module over that mesh)"
        )
    spec = param._spec
    if spec.mesh != spmd_mesh:
        raise ValueError(
            f"fully_shard: with dp_mesh_dims, parameter {fqn!r} must be a DTensor on the mesh "
            f"passed to fully_shard ({spmd_mesh}), got one on {spec.mesh}"
        )
    names = spmd_mesh.mesh_dim_names or ()
    for axis in (*dp_axes.shard, *dp_axes.replicate):
        if not isinstance(spec.placements[axis], Replicate):
            raise ValueError(
                f"fully_shard: parameter {fqn!r} is placed {spec.placements}; with dp_mesh_dims "
                f"it must be Replicate() on the data-parallel axis {names[axis]!r}"
            )
    placements = list(spec.placements)
    for axis in dp_axes.shard:
        split = math.prod(
            spmd_mesh.size(later)
            for later in range(axis + 1, spmd_mesh.ndim)
            if isinstance(p := spec.placements[later], Shard | _StridedShard) and p.dim == dim
        )
        placements[axis] = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
    sharded_mesh: DeviceMesh = spmd_mesh
    if len(dp_axes.shard) > 1:
        # Several shard axes are one flattened axis (the last of ``mesh``): the
        # sharded DTensor lives on the other axes plus ``mesh`` where the first
        # shard axis was (replicate axes move in front of it, as in ``mesh``).
        meshes: list[DeviceMesh] = []
        flat: list[Placement] = []
        for axis, name in enumerate(names):
            if axis == dp_axes.shard[0]:
                meshes.append(mesh)
                flat.extend((*(Replicate(),) * (mesh.ndim - 1), placements[axis]))
            elif axis in dp_axes.shard or (axis in dp_axes.replicate and mesh.ndim == 2):
                continue
            else:
                meshes.append(spmd_mesh[name])
                flat.append(placements[axis])
        sharded_mesh = DeviceMesh._concatenate(meshes)
        placements = flat
    local = param.to_local()
    assert isinstance(local, torch.Tensor)
    return _Placement(
        local,
        sharded_mesh,
        tuple(placements),
        spec,
        frozenset((*dp_axes.shard, *dp_axes.replicate)),
    )


def _check_even_split(
    fqn: str, data_shape: torch.Size, shard_dim: int, size: int, shard_world: int
) -> None:
    if shard_dim != 0 and size % shard_world != 0:
        raise NotImplementedError(
            f"fully_shard: parameter {fqn!r} is sharded on dim {shard_dim}, whose size "
            f"{size} (shape {tuple(data_shape)}) does not divide evenly over {shard_world} "
            "ranks; only dim 0 may be split unevenly: return Shard(0) (or None) from "
            "shard_placement_fn for it"
        )


def _padded_shard(
    data: torch.Tensor,
    shard_dim: int,
    rows: range,
    padded_rows: int,
    device: torch.device,
    pin_memory: bool,
) -> torch.Tensor:
    """This rank's ``rows`` of ``data`` along ``shard_dim``, zero-padded to ``padded_rows``."""
    padded_shape = _with_dim(data.shape, shard_dim, padded_rows)
    padded = torch.zeros(padded_shape, dtype=data.dtype, device=device)
    if data.device.type == "meta":
        return padded
    with torch.no_grad():
        padded.narrow(shard_dim, 0, len(rows)).copy_(data.narrow(shard_dim, rows.start, len(rows)))
    return padded.pin_memory() if pin_memory else padded


def _padded_subclass_shard(
    data: torch.Tensor,
    shard_dim: int,
    world: int,
    rank: int,
    padded_rows: int,
    device: torch.device,
) -> torch.Tensor:
    """This rank's chunk of a tensor subclass, padded, made with ops subclasses implement.

    ``torch.chunk``, ``new_zeros`` and a leading-slice ``copy_`` are what
    torchao's NF4 and float8 tensors support (PyTorch shards them the same way);
    a general slice is not.
    """
    chunks = torch.chunk(data, world, dim=shard_dim)
    padded_shape = _with_dim(data.shape, shard_dim, padded_rows)
    if rank < len(chunks):
        padded = _pad_subclass(chunks[rank], padded_shape, shard_dim)
    else:  # ``torch.chunk`` ran out of rows before this rank: all padding
        padded = data.new_zeros(padded_shape)
    if padded.device != device and data.device.type != "meta":
        padded = padded.to(device)
    return padded


def _pad_subclass(piece: torch.Tensor, padded_shape: torch.Size, dim: int) -> torch.Tensor:
    """A copy of ``piece`` zero-padded along ``dim`` to ``padded_shape``, by the subclass's ops.

    Always new storage (a chunk of the full parameter must not keep it alive).
    """
    padded = piece.new_zeros(padded_shape)
    if piece.device.type != "meta" and piece.numel() > 0:
        with torch.no_grad():
            padded.narrow(dim, 0, piece.size(dim)).copy_(piece)
    return padded


def _last_axis(mesh: DeviceMesh) -> DeviceMesh:
    """The shard axis of a data-parallel mesh (its last), as a 1-D mesh."""
    names = mesh.mesh_dim_names
    assert names is not None, "a data-parallel mesh of several axes names them"
    return mesh[names[-1]]


def _with_dim(shape: torch.Size, dim: int, size: int) -> torch.Size:
    return torch.Size((*shape[:dim], size, *shape[dim + 1 :]))


def _make_sharded_param(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    full_shape: torch.Size,
    requires_grad: bool,
) -> nn.Parameter:
    dtensor = contiguous_dtensor(local, mesh, placements, full_shape)
    return nn.Parameter(dtensor, requires_grad=requires_grad)
