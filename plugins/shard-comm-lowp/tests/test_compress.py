"""The fp16/bf16 compression hooks against a reducer that plays every rank in one process."""

from __future__ import annotations

import threading

import pytest
import torch

from shard_comm_lowp import LowPrecisionCompressHook, bf16_compress, fp16_compress
from shard_core.errors import LayoutError
from shard_core.protocols import CommHook, GradReducer


class SimulatedReducer:
    """A ``GradReducer`` for one process that plays all ranks.

    ``peers[r]`` is rank ``r``'s gradient; the reducer casts the peers to the
    dtype it is handed (as their own hooks would), divides each by
    ``pre_divide``, sums them in rank order in that dtype, divides by
    ``post_divide`` and keeps ``rank``'s chunk (or everything, for an
    all-reduce). It records the tensors it was handed.
    """

    def __init__(
        self,
        peers: list[torch.Tensor],
        rank: int = 0,
        pre_divide: float = 1.0,
        post_divide: float = 1.0,
    ) -> None:
        self.peers = peers
        self.rank = rank
        self._pre = pre_divide
        self._post = post_divide
        self.seen: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    @property
    def world_size(self) -> int:
        return len(self.peers)

    @property
    def data_parallel_size(self) -> int:
        return len(self.peers)

    @property
    def pre_divide(self) -> float:
        return self._pre

    @property
    def post_divide(self) -> float:
        return self._post

    def reduce(self, grad: torch.Tensor, output: torch.Tensor | None) -> None:
        self.seen.append((grad, output))
        total = torch.zeros_like(grad)
        for r, peer in enumerate(self.peers):
            mine = grad if r == self.rank else peer.to(grad.dtype)
            total += mine / self._pre
        total /= self._post
        if output is None:
            grad.copy_(total)
        else:
            output.copy_(total.chunk(self.world_size)[self.rank])


def _f32(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_simulated_reducer_is_a_grad_reducer() -> None:
    """The test double satisfies the GradReducer protocol, so the tests exercise the contract."""
    assert isinstance(SimulatedReducer([_f32(0.0)]), GradReducer)


def test_hooks_are_comm_hooks_with_their_names_and_dtypes() -> None:
    """Both exported hooks satisfy CommHook and carry their registered name and dtype."""
    assert isinstance(bf16_compress, CommHook)
    assert isinstance(fp16_compress, CommHook)
    assert (bf16_compress.name, bf16_compress.dtype) == ("bf16_compress", torch.bfloat16)
    assert (fp16_compress.name, fp16_compress.dtype) == ("fp16_compress", torch.float16)
    assert repr(bf16_compress) == (
        "LowPrecisionCompressHook(name='bf16_compress', dtype=torch.bfloat16)"
    )


def test_bf16_reduce_scatter_sums_in_bf16_and_casts_back() -> None:
    """Reduce-scatter runs in bf16: 1 + 2**-8 rounds to 1 in the sum, and the fp32 output has it."""
    grad = _f32(1.0, 3.0, 5.0, 7.0)
    peer = _f32(2.0**-8, 1.0, 0.0, 0.0)
    output = torch.full((2,), -1.0)
    reducer = SimulatedReducer([grad.clone(), peer], rank=0)
    bf16_compress(reducer, grad, output)
    # fp32 would give 1.00390625; bf16 rounds the sum half to even.
    assert output.tolist() == [1.0, 4.0]
    assert output.dtype == torch.float32
    assert grad.tolist() == [1.0, 3.0, 5.0, 7.0]
    ((seen_grad, seen_output),) = reducer.seen
    assert seen_grad.dtype == torch.bfloat16
    assert seen_output is not None
    assert seen_output.dtype == torch.bfloat16


def test_bf16_cast_rounds_each_rank_gradient_before_the_sum() -> None:
    """A gradient of 1 + 2**-8 on each of two ranks arrives as 2.0, not 2.0078125."""
    grads = [_f32(1.0 + 2.0**-8, 2.0), _f32(1.0 + 2.0**-8, 6.0)]
    output = torch.zeros(1)
    bf16_compress(SimulatedReducer(grads, rank=1), grads[1].clone(), output)
    assert output.tolist() == [8.0]
    output0 = torch.zeros(1)
    bf16_compress(SimulatedReducer(grads, rank=0), grads[0].clone(), output0)
    assert output0.tolist() == [2.0]


def test_bf16_all_reduce_writes_back_into_grad_in_place() -> None:
    """Without an output the hook all-reduces and leaves the bf16-rounded sum in the fp32 grad."""
    grad = _f32(1.0, 0.5, -3.0)
    peers = [grad.clone(), _f32(2.0**-8, 0.25, 3.0), _f32(0.0, 0.25, 1.0)]
    storage = grad.untyped_storage().data_ptr()
    reducer = SimulatedReducer(peers, rank=0, post_divide=2.0)
    bf16_compress(reducer, grad, None)
    assert grad.tolist() == [0.5, 0.5, 0.5]
    assert grad.dtype == torch.float32
    assert grad.untyped_storage().data_ptr() == storage
    ((seen_grad, seen_output),) = reducer.seen
    assert (seen_grad.dtype, seen_output) == (torch.bfloat16, None)


def test_fp16_rounds_at_eleven_bits() -> None:
    """fp16 keeps 10 mantissa bits: 1 + 2**-11 on two ranks sums to 2.0, 1 + 2**-10 survives."""
    grads = [_f32(1.0 + 2.0**-11, 1.0 + 2.0**-10), _f32(1.0 + 2.0**-11, 1.0 + 2.0**-10)]
    grad = grads[0].clone()
    fp16_compress(SimulatedReducer(grads), grad, None)
    assert grad.tolist() == [2.0, 2.0 + 2.0**-9]


def test_fp16_overflows_without_pre_divide_and_not_with_it() -> None:
    """The sum really is taken in fp16: 40000 + 40000 is inf, unless the reducer divides first."""
    grads = [_f32(40000.0, 1.0), _f32(40000.0, 1.0)]
    grad = grads[0].clone()
    fp16_compress(SimulatedReducer(grads), grad, None)
    assert grad.tolist() == [float("inf"), 2.0]
    grad = grads[0].clone()
    fp16_compress(SimulatedReducer(grads, pre_divide=2.0), grad, None)
    assert grad.tolist() == [40000.0, 1.0]


def test_gradient_already_in_the_hook_dtype_is_reduced_without_staging() -> None:
    """A bf16 gradient and output reach the reducer as the very tensors given, with no copy."""
    grad = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)
    output = torch.zeros(2, dtype=torch.bfloat16)
    reducer = SimulatedReducer([grad.clone(), grad.clone()])
    bf16_compress.release_staging()
    bf16_compress(reducer, grad, output)
    assert reducer.seen == [(grad, output)]
    assert output.tolist() == [2.0, 4.0]
    assert bf16_compress.staging_nbytes == 0


def test_output_dtype_other_than_the_hook_dtype_goes_through_staging() -> None:
    """A bf16 gradient with an fp32 output is reduced in bf16 and cast into the fp32 output."""
    grad = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    output = torch.zeros(1, dtype=torch.float32)
    reducer = SimulatedReducer([grad.clone(), torch.tensor([2.0**-8, 0.0])])
    bf16_compress(reducer, grad, output)
    assert output.tolist() == [1.0]
    assert reducer.seen[0][0] is not grad


def test_staging_buffer_is_reused_across_calls_on_cpu() -> None:
    """Two calls of one size reduce from the same memory; a larger call grows the buffer once."""
    hook = LowPrecisionCompressHook("test_bf16", torch.bfloat16)
    peers = [torch.ones(8), torch.ones(8)]
    reducer = SimulatedReducer(peers)
    hook(reducer, torch.ones(8), torch.zeros(4))
    hook(reducer, torch.ones(8), torch.zeros(4))
    first, second = reducer.seen
    assert first[0].data_ptr() == second[0].data_ptr()
    assert hook.staging_nbytes == (8 + 4) * 2
    big = SimulatedReducer([torch.ones(16), torch.ones(16)])
    hook(big, torch.ones(16), torch.zeros(8))
    assert hook.staging_nbytes == (16 + 8) * 2
    small = SimulatedReducer([torch.ones(4), torch.ones(4)])
    hook(small, torch.ones(4), None)
    assert small.seen[0][0].data_ptr() == big.seen[0][0].data_ptr()
    assert hook.staging_nbytes == (16 + 8) * 2
    hook.release_staging()
    assert hook.staging_nbytes == 0


def test_staging_buffers_are_per_thread() -> None:
    """Another thread gets its own staging buffer and the calling thread's stays untouched."""
    hook = LowPrecisionCompressHook("test_fp16", torch.float16)
    hook(SimulatedReducer([torch.ones(2)]), torch.ones(2), None)
    seen_in_thread: list[int] = []

    def other() -> None:
        hook(SimulatedReducer([torch.ones(6)]), torch.ones(6), None)
        seen_in_thread.append(hook.staging_nbytes)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen_in_thread == [6 * 2]
    assert hook.staging_nbytes == 2 * 2


def test_no_staging_is_kept_off_the_cpu() -> None:
    """On a non-CPU device (meta here) the hook allocates per call and keeps no buffer."""
    hook = LowPrecisionCompressHook("test_bf16", torch.bfloat16)
    grad = torch.empty(4, device="meta")
    output = torch.empty(2, device="meta")
    reducer = SimulatedReducer([torch.empty(4, device="meta")] * 2)
    hook(reducer, grad, output)
    assert reducer.seen[0][0].device.type == "meta"
    assert reducer.seen[0][0].dtype == torch.bfloat16
    assert hook.staging_nbytes == 0


def test_integer_gradient_is_refused() -> None:
    """Compressing an integer gradient is a LayoutError naming the hook and the dtype."""
    grad = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(
        LayoutError,
        match=r"^comm hook 'bf16_compress': gradient dtype torch\.int64 is not a floating "
        r"point type; compress only floating point gradients$",
    ):
        bf16_compress(SimulatedReducer([grad]), grad, None)


def test_output_of_the_wrong_size_is_refused() -> None:
    """An output that is not grad.numel() // world_size long names both sizes and the fix."""
    with pytest.raises(
        LayoutError,
        match=r"^comm hook 'fp16_compress': output has 3 elements but a gradient of 10 "
        r"elements over world size 2 needs 5 and a multiple of 2; pad the flat gradient "
        r"to a multiple of the world size$",
    ):
        fp16_compress(SimulatedReducer([torch.zeros(10)] * 2), torch.zeros(10), torch.zeros(3))


def test_output_on_another_device_is_refused() -> None:
    """An output on another device than the gradient is a LayoutError naming both devices."""
    with pytest.raises(
        LayoutError,
        match=r"^comm hook 'bf16_compress': output is on meta but the gradient is on cpu; "
        r"give an output on the gradient's device$",
    ):
        bf16_compress(
            SimulatedReducer([torch.zeros(2)] * 2), torch.zeros(2), torch.empty(1, device="meta")
        )


def test_hook_dtype_must_be_16_bit_float() -> None:
    """Building a compression hook for float32 is refused with the dtypes that work."""
    with pytest.raises(
        LayoutError,
        match=r"^comm hook 'f32': dtype torch\.float32 is not a 16-bit float; "
        r"use torch\.float16 or torch\.bfloat16$",
    ):
        LowPrecisionCompressHook("f32", torch.float32)
