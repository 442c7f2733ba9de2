"""FSDP2's all-gather extension: a tensor subclass decides what its parameter sends.

[Note: the tensor-subclass all-gather contract]
A sharded parameter whose local tensor defines both ``fsdp_pre_all_gather``
and ``fsdp_post_all_gather`` (torchao's ``NF4Tensor`` and float8 training
weights, for example) is gathered on its own terms, as PyTorch's
``fully_shard`` does it:

- before each all-gather, ``fsdp_pre_all_gather`` is called on this rank's
  shard (unpadded: a short shard must return inputs of the padded size), with
  the mesh alone or with ``(mesh, outer_size, outer_stride, module,
  mp_policy)`` as its signature asks; it returns the tensors to gather (any
  number, any dtypes: NF4 sends three, float8 one ``float8_e4m3fn``) and
  metadata for the other side;
- each returned tensor is gathered into its own output of ``world * numel``
  elements, kept for the parameter's life: its storage is released when the
  unit reshards and grown back before the next gather, so that
- ``fsdp_post_all_gather(outputs, metadata, param_dtype)`` builds the full
  parameter once, and later gathers call it with ``out=`` that parameter: the
  subclass refreshes it in place over the same output storage (NF4 checks
  exactly that), and the parameter object autograd saw stays the same.

The tensors ``fsdp_post_all_gather`` names as its inner tensors are released
with the outputs when the unit reshards. How the outputs share one
collective with the unit's other parameters (as bytes when dtypes differ) is
the layout's business (``_per_param_layout.py``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from shard_core import contiguous_stride
from shard_runtime._storage import alloc_storage, free_storage

__all__ = ["AllGatherExtension", "extension_of", "is_tensor_subclass"]


def is_tensor_subclass(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (a parameter or its data) is a user's tensor subclass, not plain.

    Such a tensor is sharded with the ops subclasses implement and may carry
    the hooks below. Fake tensors (``FakeTensorMode``, shard-testing's
    simulation) stand for plain ones.
    """
    data = tensor.detach() if isinstance(tensor, nn.Parameter) else tensor
    return type(data) is not torch.Tensor and not isinstance(data, FakeTensor)


def extension_of(fqn: str, local: torch.Tensor) -> AllGatherExtension | None:
    """The extension of a parameter whose sharded local tensor is ``local``; ``None``: plain.

    A subclass that defines one hook without the other is refused (PyTorch
    raises the same ``AssertionError``): half a contract would gather bytes
    nothing can rebuild.
    """
    has_pre = hasattr(local, "fsdp_pre_all_gather")
    has_post = hasattr(local, "fsdp_post_all_gather")
    if has_pre != has_post:
        have, lack = (
            ("fsdp_pre_all_gather", "fsdp_post_all_gather")
            if has_pre
            else ("fsdp_post_all_gather", "fsdp_pre_all_gather")
        )
        raise AssertionError(
            f"fully_shard: parameter {fqn!r} is a {type(local).__name__} that defines {have} "
            f"but not {lack}. Both fsdp_pre_all_gather and fsdp_post_all_gather should be "
            "defined if using all-gather extensions"
        )
    if not has_pre:
        return None
    return AllGatherExtension(fqn)


@dataclass(eq=False, slots=True)
class AllGatherExtension:
    """One parameter's hooks and what they keep between gathers; see the module docstring."""

    fqn: str
    # - what the last fsdp_pre_all_gather said (valid until the gather is finished)
    metadata: object = None
    input_shapes: list[torch.Size] = field(default_factory=list)
    input_dtypes: list[torch.dtype] = field(default_factory=list)
    # - kept across steps: outputs (1-D, world * numel each) and the post hook's inner tensors
    outputs: list[torch.Tensor] = field(default_factory=list)
    inner_tensors: tuple[torch.Tensor, ...] = ()
    built: bool = False  # fsdp_post_all_gather has built the full parameter

    def reset(self) -> None:
        """Forget the built parameter and outputs (new shards: ``to_empty``, a new dtype)."""
        self.outputs, self.inner_tensors, self.built = [], (), False
        self.metadata, self.input_shapes, self.input_dtypes = None, [], []

    def pre_all_gather(
        self,
        shard: torch.Tensor,
        mesh: object,
        full_shape: torch.Size,
        module: nn.Module,
        mp_policy: object,
        padded_shape: torch.Size,
    ) -> list[torch.Tensor]:
        """Call the pre hook on ``shard`` (unpadded); return its inputs, flattened.

        The hook's signature is read at each call, as PyTorch does: the old
        one-argument form gets the mesh alone.
        """
        pre = shard.fsdp_pre_all_gather  # type: ignore[attr-defined]
        takes = len(inspect.signature(pre).parameters)
        if takes not in (1, 5):
            raise AssertionError(
                f"fully_shard: parameter {self.fqn!r}: {type(shard).__name__}.fsdp_pre_all_gather "
                f"takes {takes} arguments; expects fsdp_pre_all_gather(self, mesh) or "
                "fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy)"
            )
        if takes == 5:
            stride = contiguous_stride(full_shape)
            inputs, self.metadata = pre(mesh, full_shape, stride, module, mp_policy)
            if shard.size() != padded_shape and any(t.size() != padded_shape for t in inputs):
                raise AssertionError(
                    f"fully_shard: parameter {self.fqn!r} (shape {tuple(full_shape)}) is sharded "
                    f"unevenly, so fsdp_pre_all_gather must return inputs of the padded shard "
                    f"size {tuple(padded_shape)}, got {[tuple(t.size()) for t in inputs]}"
                )
        else:
            inputs, self.metadata = pre(mesh)
        self.input_shapes = [t.size() for t in inputs]
        self.input_dtypes = [t.dtype for t in inputs]
        return [t.reshape(-1) for t in inputs]

    def outputs_for(self, world: int, device: torch.device) -> list[torch.Tensor]:
        """The outputs the gathered inputs are copied into: made once, regrown after a reshard."""
        if not self.outputs:
            self.outputs = [
                torch.empty(world * shape.numel(), dtype=dtype, device=device)
                for shape, dtype in zip(self.input_shapes, self.input_dtypes, strict=True)
            ]
        else:
            for output in self.outputs:
                alloc_storage(output)
        return self.outputs

    def post_all_gather(
        self, shard: torch.Tensor, param_dtype: torch.dtype, out: nn.Parameter | None
    ) -> torch.Tensor | None:
        """Call the post hook of ``shard`` on the outputs; in place into ``out`` once built.

        Returns the new full tensor the first time, ``None`` after.
        """
        outputs = tuple(
            out_.view(-1, *shape[1:])
            for out_, shape in zip(self.outputs, self.input_shapes, strict=True)
        )
        metadata, self.metadata = self.metadata, None
        post = shard.fsdp_post_all_gather  # type: ignore[attr-defined]
        if self.built:
            assert out is not None
            for tensor in self.inner_tensors:
                alloc_storage(tensor)
            post(outputs, metadata, param_dtype, out=out)
            return None
        full, inner = post(outputs, metadata, param_dtype)
        self.inner_tensors = tuple(inner)
        self.built = True
        assert isinstance(full, torch.Tensor)
        return full

    def free(self) -> None:
        """Release the outputs' and inner tensors' storage (the unit reshards)."""
        for tensor in (*self.outputs, *self.inner_tensors):
            free_storage(tensor)
