"""CPU copies of a state dict for a background save, made in one pass of plain tensor copies.

``async_save`` must copy every tensor before it returns (training changes
them at once), and that copy is time the training loop stands still. DCP's
``DefaultStager`` deep-copies the state dict, which sends each DTensor
through DTensor's dispatch: about 0.1 ms a tensor on CPU, 13 ms for the
123 tensors of ``shard train``'s demo model and AdamW per rank, 16 times the
time the bytes take to copy. :class:`StagingBuffers` instead keeps, per
state-dict path, a CPU tensor (and, for a DTensor, a DTensor around it with
the source's mesh and placements) from one save to the next, and copies only
local tensors into them: ``Tensor.copy_`` on plain tensors.

A state dict with anything else among its leaves (a ``Stateful``, a
``ShardedTensor``, a DTensor whose local tensor is itself a subclass, such as
torchao's) is left to ``DefaultStager``, whole: what it copies correctly is
not second-guessed here. The copies made before such a leaf was found are
dropped, and later calls are refused at once: the saves of one run share a
layout, and each refused call would otherwise copy (and keep) the tensors
before that leaf again, beside ``DefaultStager``'s own copy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

__all__ = ["StagingBuffers"]

# Leaves copied by value: immutable, so the staged dict may share them.
_IMMUTABLE = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)

# What a kept copy was made for: a path's copy is reused only for a source that matches it.
_Signature = tuple[torch.dtype, torch.Size, bool, DTensorSpec | None]


class _Unsupported(Exception):
    """A leaf this module does not copy; the whole state dict goes to ``DefaultStager``."""


class StagingBuffers:
    """CPU copies of state dicts' tensors, kept from one :meth:`stage` to the next.

    Args:
        pin_memory: allocate the copies in pinned memory and copy without
            blocking (then wait for the copies once, at the end); for
            accelerator tensors.
    """

    def __init__(self, *, pin_memory: bool) -> None:
        self._pin_memory = pin_memory
        self._kept: dict[tuple[Any, ...], tuple[_Signature, torch.Tensor, torch.Tensor]] = {}
        self._refused = False

    def stage(self, state_dict: Mapping[str, Any]) -> dict[str, Any] | None:
        """A copy of ``state_dict`` whose tensors live in the kept CPU memory.

        Returns ``None``, keeping nothing, when a leaf is of a kind this class
        leaves to ``DefaultStager``, and from then on; see the module docstring.
        """
        if self._refused:
            return None
        try:
            staged = self._copy(dict(state_dict), ())
        except _Unsupported:
            self._refused = True
            self._kept.clear()
            return None
        if self._pin_memory:
            torch.accelerator.synchronize()
        assert isinstance(staged, dict)
        return staged

    def nbytes(self) -> int:
        """Bytes of CPU memory the kept copies hold."""
        return sum(buffer.nbytes for _, buffer, _ in self._kept.values())

    def _copy(self, value: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value, path)
        if type(value) is dict or type(value) is OrderedDict:
            return type(value)((key, self._copy(item, (*path, key))) for key, item in value.items())
        if type(value) is list or type(value) is tuple:
            return type(value)(self._copy(item, (*path, index)) for index, item in enumerate(value))
        if isinstance(value, _IMMUTABLE):
            return value
        raise _Unsupported(path)

    def _copy_tensor(self, tensor: torch.Tensor, path: tuple[Any, ...]) -> torch.Tensor:
        spec: DTensorSpec | None
        if type(tensor) is DTensor and _plain(tensor._local_tensor):
            local, spec = tensor._local_tensor, tensor._spec
        elif _plain(tensor):
            local, spec = tensor, None
        else:
            raise _Unsupported(path)
        signature: _Signature = (
            local.dtype,
            local.shape,
            tensor.requires_grad,
            spec,
        )
        kept = self._kept.get(path)
        if kept is None or kept[0] != signature:
            # Contiguous whatever the source's strides: what is written is the elements.
            buffer = torch.empty(
                local.shape, dtype=local.dtype, device="cpu", pin_memory=self._pin_memory
            )
            # The source's spec as is: a DTensor of an accelerator mesh whose local tensor is
            # on the CPU is what DCP's own staging makes too (``from_local`` would move it).
            # requires_grad as the source's: DCP records it in the checkpoint's metadata.
            staged = (
                buffer.requires_grad_(tensor.requires_grad)
                if spec is None
                else DTensor(buffer, spec, requires_grad=tensor.requires_grad)  # type: ignore[no-untyped-call]
            )
            kept = (signature, buffer, staged)
            self._kept[path] = kept
        _, buffer, staged = kept
        with torch.no_grad():
            buffer.copy_(local, non_blocking=self._pin_memory)
        return staged


def _plain(tensor: torch.Tensor) -> bool:
    """A tensor of torch's own class (or a parameter of it), not a subclass."""
    return type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter
