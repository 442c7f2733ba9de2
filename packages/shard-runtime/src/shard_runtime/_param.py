"""One parameter's life under per-parameter sharding.

A :class:`ShardedParam` owns both faces of one original parameter:

- the *sharded* face, registered on the module between steps: an
  ``nn.Parameter`` holding a ``DTensor`` placed ``Shard(0)`` (or
  ``(Replicate(), Shard(0))`` on a 2-D mesh) whose local tensor is
  ``torch.chunk(full, n, dim=0)[rank]``. Its data lives in a padded buffer of
  ``ceil(dim0 / n)`` rows so every rank contributes the same number of bytes
  to an all-gather; the local tensor is a view of the first rows, so the
  optimizer's in-place updates land directly in what the next all-gather sends.
- the *unsharded* face, registered while the unit computes: a plain leaf
  ``nn.Parameter`` of the full shape (in the compute dtype), a view of a padded
  buffer of ``n * ceil(dim0 / n)`` rows. Its storage is released when the unit
  reshards and re-grown before the next all-gather writes into it, so the
  ``Parameter`` object autograd saw stays the same across the step.

[Note: version counters]
Writing the all-gathered data into the unsharded parameter is an in-place
operation on a tensor that autograd may have saved during forward. The write
restores the exact values autograd saved, so it is hidden from autograd's
version check; anything else would make every backward after a reshard fail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from shard_core import contiguous_stride

__all__ = ["ParamOwner", "ShardedParam"]


@dataclass(frozen=True, slots=True)
class ParamOwner:
    """A (module, attribute) pair a parameter is registered under (tied weights have several)."""

    module: nn.Module
    name: str


@dataclass(eq=False, slots=True)
class ShardedParam:
    """Sharded and unsharded faces of one parameter; see the module docstring."""

    fqn: str  # qualified name in the outermost sharded module known so far
    local_name: str  # qualified name in the module(s) of its own unit
    owners: list[ParamOwner]
    full_shape: torch.Size
    requires_grad: bool
    # - sharding
    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shard_rank: int
    shard_world: int
    padded_rows: int  # ceil(dim0 / shard_world): rows each rank contributes
    local_rows: int  # rows of the real (unpadded) local shard
    # - sharded face
    padded_shard: torch.Tensor  # ND, (padded_rows, *full_shape[1:]), sharded dtype
    sharded_param: nn.Parameter  # DTensor parameter, local = padded_shard[:local_rows]
    # - unsharded face (compute dtype), storage released while sharded
    unsharded_padded: torch.Tensor = field(init=False)  # ND, (padded_rows * shard_world, ...)
    unsharded_param: nn.Parameter = field(init=False)

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
    ) -> ShardedParam:
        """Shard ``param`` (a plain full tensor) over the last axis of ``mesh``.

        ``pin_memory`` pins the shard (CPU offload with an accelerator) so its
        copies to the device can run asynchronously.
        """
        shard_world = mesh.size(-1)
        shard_rank = mesh.get_local_rank(-1) if mesh.ndim > 1 else mesh.get_local_rank()
        placements: tuple[Placement, ...] = (
            (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
        )
        full_shape = param.shape
        dim0 = full_shape[0]
        padded_rows = math.ceil(dim0 / shard_world)
        start = min(shard_rank * padded_rows, dim0)
        local_rows = min(padded_rows, dim0 - start)
        if param.device.type == "meta":  # stays on meta until module.to_empty(...)
            shard_device = param.device
        padded_shard = torch.zeros(
            (padded_rows, *full_shape[1:]), dtype=param.dtype, device=shard_device
        )
        if param.device.type != "meta":
            with torch.no_grad():
                padded_shard[:local_rows].copy_(param.detach()[start : start + local_rows])
            if pin_memory:
                padded_shard = padded_shard.pin_memory()
        sharded_param = _make_sharded_param(
            padded_shard[:local_rows], mesh, placements, full_shape, param.requires_grad
        )
        self = cls(
            fqn=fqn,
            local_name=fqn,
            owners=owners,
            full_shape=full_shape,
            requires_grad=param.requires_grad,
            mesh=mesh,
            placements=placements,
            shard_rank=shard_rank,
            shard_world=shard_world,
            padded_rows=padded_rows,
            local_rows=local_rows,
            padded_shard=padded_shard,
            sharded_param=sharded_param,
        )
        self.init_unsharded(param.dtype, shard_device)
        return self

    def init_unsharded(self, dtype: torch.dtype, device: torch.device) -> None:
        """(Re)create the unsharded face in ``dtype`` on ``device``, storage released."""
        rows = self.padded_rows * self.shard_world
        self.unsharded_padded = torch.empty(
            (rows, *self.full_shape[1:]), dtype=dtype, device=device
        )
        self.unsharded_param = nn.Parameter(
            self.unsharded_padded[: self.full_shape[0]], requires_grad=self.requires_grad
        )
        self.free_unsharded()

    # -------------------------------------------------------------- sizes

    @property
    def padded_numel(self) -> int:
        """Elements one rank contributes to the unit's all-gather for this parameter."""
        return self.padded_shard.numel()

    @property
    def row_numel(self) -> int:
        """Elements in one dim-0 row."""
        return math.prod(self.full_shape[1:])

    # -------------------------------------------------------------- storage

    def alloc_unsharded(self) -> None:
        """Grow the unsharded storage back before the all-gathered data is written."""
        storage = self.unsharded_padded.untyped_storage()
        nbytes = self.unsharded_padded.numel() * self.unsharded_padded.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)

    def free_unsharded(self) -> None:
        """Release the unsharded storage; the ``Parameter`` object stays for autograd."""
        storage = self.unsharded_padded.untyped_storage()
        if storage.size() != 0:
            storage.resize_(0)

    @property
    def is_unsharded_allocated(self) -> bool:
        """Whether the unsharded storage currently holds data."""
        return self.unsharded_padded.untyped_storage().size() != 0

    def unsharded_rows_view(self) -> torch.Tensor:
        """The padded unsharded buffer as ``(shard_world, padded_numel)``, for copy-out."""
        return self.unsharded_padded.view(self.shard_world, self.padded_numel)

    # -------------------------------------------------------------- registration

    def to_sharded(self) -> None:
        """Register the sharded DTensor parameter on every owner."""
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
        """
        local = self.sharded_param.to_local()  # type: ignore[attr-defined]
        assert isinstance(local, torch.Tensor)
        if (
            local.dtype == self.padded_shard.dtype
            and local.device == self.padded_shard.device
            and local.data_ptr() == self.padded_shard.data_ptr()
        ):
            return
        padded = torch.zeros(
            (self.padded_rows, *self.full_shape[1:]), dtype=local.dtype, device=local.device
        )
        if local.device.type != "meta":
            with torch.no_grad():
                padded[: self.local_rows].copy_(local)
        self.padded_shard = padded
        self.sharded_param._local_tensor = padded[: self.local_rows]  # type: ignore[attr-defined]

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
                self.sharded_param.grad = DTensor.from_local(
                    local_grad,
                    self.mesh,
                    self.placements,
                    run_check=False,
                    shape=self.full_shape,
                    stride=contiguous_stride(self.full_shape),
                )
        else:
            grad_local = grad.to_local()  # type: ignore[attr-defined]
            assert isinstance(grad_local, torch.Tensor)
            grad_local.add_(local_grad)


def _make_sharded_param(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    full_shape: torch.Size,
    requires_grad: bool,
) -> nn.Parameter:
    dtensor = DTensor.from_local(
        local,
        mesh,
        placements,
        run_check=False,
        shape=full_shape,
        stride=contiguous_stride(full_shape),
    )
    return nn.Parameter(dtensor, requires_grad=requires_grad)
