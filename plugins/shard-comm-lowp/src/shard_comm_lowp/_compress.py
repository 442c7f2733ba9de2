"""Gradient compression to fp16 or bf16 for the duration of the reduction.

A unit's gradient is reduced across ranks once per step, and on a slow
interconnect that reduction is the step's bottleneck. Casting the gradient to
a 16-bit float before the collective halves the bytes on the wire; the result
is cast back into the gradient's own dtype, so optimizer state and the sharded
gradient stay in full precision. The reducer handed to the hook applies the
unit's divide factors in the low-precision dtype, which is what keeps fp16
sums from overflowing.
"""

from __future__ import annotations

import threading

import torch

from shard_core.errors import LayoutError
from shard_core.protocols import GradReducer

__all__ = ["LowPrecisionCompressHook", "bf16_compress", "fp16_compress"]

# [Note: Staging buffers]
# The hook runs for every unit on every step, so it keeps the low-precision
# copy of the gradient (and of the reduce-scatter output) in one staging
# buffer per thread and device instead of allocating two tensors per call.
# The buffer grows to the largest unit seen and the smaller units use its
# front; it never holds one buffer per unit, which would keep half a
# full-precision copy of every unit's gradient alive between steps.
#
# Reuse is only safe where a call's work is finished when the call returns:
# that holds on CPU, where ``GradReducer.reduce`` is a blocking collective and
# every copy is synchronous. On an accelerator the copies and the collective
# are queued on streams; reusing a buffer there would race with a reduction
# still in flight on another stream. The caching allocator of those devices
# already recycles memory in a stream-aware way, so off the CPU the hook
# allocates a fresh staging tensor per call and keeps nothing.
#
# Buffers are per thread (``threading.local``) because the registry hands the
# same hook object to every unit and every model in the process; a lock would
# have to be held across a collective, which can deadlock two threads that
# reduce over different groups.


class _Staging(threading.local):
    """The calling thread's staging buffers, one per (device, dtype)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


class LowPrecisionCompressHook:
    """A :class:`~shard_core.protocols.CommHook` that reduces in a 16-bit float dtype.

    Casts the gradient to ``dtype``, reduces it through the reducer
    (reduce-scatter into a low-precision output when ``output`` is given,
    all-reduce in place otherwise) and casts the result back into ``output``
    or into ``grad``, whatever their dtypes. A gradient (and output) already
    in ``dtype`` is reduced as is.
    See [Note: Staging buffers] for the memory it keeps between calls.

    Attributes:
        name: The registered name (``"bf16_compress"``), used in error messages.
        dtype: The dtype the gradient travels in.
    """

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise LayoutError(
                f"comm hook {name!r}: dtype {dtype} is not a 16-bit float; "
                "use torch.float16 or torch.bfloat16"
            )
        self.name = name
        self.dtype = dtype
        self._staging = _Staging()

    def __repr__(self) -> str:
        return f"LowPrecisionCompressHook(name={self.name!r}, dtype={self.dtype})"

    def __call__(
        self, reducer: GradReducer, grad: torch.Tensor, output: torch.Tensor | None
    ) -> None:
        self._check(reducer, grad, output)
        if grad.dtype == self.dtype and (output is None or output.dtype == self.dtype):
            reducer.reduce(grad, output)
            return
        numel = grad.numel()
        out_numel = 0 if output is None else output.numel()
        staging = self._staging_buffer(grad.device, numel + out_numel)
        low_grad = staging[:numel].view(grad.shape)
        low_grad.copy_(grad)
        if output is None:
            reducer.reduce(low_grad, None)
            grad.copy_(low_grad)
            return
        low_output = staging[numel:].view(output.shape)
        reducer.reduce(low_grad, low_output)
        output.copy_(low_output)

    @property
    def staging_nbytes(self) -> int:
        """Bytes of staging buffers the calling thread holds (CPU only; see the note)."""
        return sum(b.numel() * b.element_size() for b in self._staging.buffers.values())

    def release_staging(self) -> None:
        """Free the calling thread's staging buffers; the next call allocates again."""
        self._staging.buffers.clear()

    def _staging_buffer(self, device: torch.device, numel: int) -> torch.Tensor:
        # See [Note: Staging buffers]
        if device.type != "cpu":
            return torch.empty(numel, dtype=self.dtype, device=device)
        key = (device, self.dtype)
        buffer = self._staging.buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=self.dtype, device=device)
            self._staging.buffers[key] = buffer
        return buffer[:numel]

    def _check(self, reducer: GradReducer, grad: torch.Tensor, output: torch.Tensor | None) -> None:
        if not grad.is_floating_point():
            raise LayoutError(
                f"comm hook {self.name!r}: gradient dtype {grad.dtype} is not a floating "
                "point type; compress only floating point gradients"
            )
        if output is None:
            return
        world_size = reducer.world_size
        if output.numel() * world_size != grad.numel():
            raise LayoutError(
                f"comm hook {self.name!r}: output has {output.numel()} elements but a "
                f"gradient of {grad.numel()} elements over world size {world_size} "
                f"needs {grad.numel() // world_size} and a multiple of {world_size}; "
                "pad the flat gradient to a multiple of the world size"
            )
        if output.device != grad.device:
            raise LayoutError(
                f"comm hook {self.name!r}: output is on {output.device} but the gradient "
                f"is on {grad.device}; give an output on the gradient's device"
            )


fp16_compress = LowPrecisionCompressHook("fp16_compress", torch.float16)
"""Reduce gradients in ``torch.float16``; registered as ``"fp16_compress"``."""

bf16_compress = LowPrecisionCompressHook("bf16_compress", torch.bfloat16)
"""Reduce gradients in ``torch.bfloat16``; registered as ``"bf16_compress"``."""
