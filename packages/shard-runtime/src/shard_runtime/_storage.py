"""Unsharded buffers whose bytes are released between uses and regrown in place.

[Note: freeing storage in place]
The full parameters are views of one unsharded buffer that the modules and
autograd hold on to. Resizing the buffer's storage to zero bytes frees the
memory while every view and ``Parameter`` object stays valid; growing it back
to the buffer's size before the all-gather writes into it makes them usable
again (FSDP2's ``alloc_storage``/``free_storage``). Both are no-ops when the
storage already has the wanted size.
"""

from __future__ import annotations

import torch

__all__ = ["alloc_storage", "free_storage"]


def alloc_storage(tensor: torch.Tensor) -> None:
    """Grow ``tensor``'s storage back to ``tensor``'s size. See [Note: freeing storage in place]."""
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def free_storage(tensor: torch.Tensor) -> None:
    """Release ``tensor``'s storage, keeping the tensor. See [Note: freeing storage in place]."""
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)
