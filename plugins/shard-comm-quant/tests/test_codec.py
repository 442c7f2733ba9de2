"""The block-quantization codec in one process: format, error bounds, error feedback, bad input."""

from __future__ import annotations

import threading

import pytest
import torch

from shard_comm_quant import DEFAULT_BLOCK_SIZE, BlockQuantCodec, int4_codec, int8_codec
from shard_core.errors import LayoutError
from shard_core.protocols import CommCodec

CODECS = [BlockQuantCodec(8, 64), BlockQuantCodec(4, 64)]
IDS = ["int8", "int4"]


def _round_trip(
    codec: BlockQuantCodec, values: torch.Tensor, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(encoded bytes, decoded float32 values) of ``values``."""
    rows, numel = values.shape
    encoded = torch.empty(rows, codec.encoded_nbytes(numel), dtype=torch.uint8)
    codec.encode(values, encoded, residual)
    decoded = torch.empty(rows, numel)
    codec.decode(encoded, decoded)
    return encoded, decoded


def _block_amax(values: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each element's block maximum magnitude, the shape of ``values``."""
    rows, numel = values.shape
    padded = -(-numel // block_size) * block_size
    x = torch.zeros(rows, padded)
    x[:, :numel] = values.abs()
    amax = x.view(rows, -1, block_size).amax(-1, keepdim=True).expand(-1, -1, block_size)
    return amax.reshape(rows, padded)[:, :numel]


def test_codecs_are_comm_codecs_with_their_factories() -> None:
    """Both registered factories build CommCodecs of their width; the default block is 256."""
    assert isinstance(int8_codec(), CommCodec)
    assert (int8_codec().bits, int8_codec().block_size) == (8, DEFAULT_BLOCK_SIZE)
    assert (int4_codec(block_size=32).bits, int4_codec(block_size=32).block_size) == (4, 32)
    assert repr(int8_codec(block_size=128)) == "BlockQuantCodec(bits=8, block_size=128)"


@pytest.mark.parametrize(
    ("bits", "block", "numel", "nbytes"),
    [(8, 256, 512, 512 + 8), (8, 256, 513, 768 + 12), (4, 256, 512, 256 + 8), (4, 8, 9, 8 + 8)],
)
def test_encoded_size_is_codes_then_one_float32_per_block(
    bits: int, block: int, numel: int, nbytes: int
) -> None:
    """A row costs its padded codes (1 or 1/2 byte each) plus 4 bytes per block."""
    assert BlockQuantCodec(bits, block).encoded_nbytes(numel) == nbytes


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
@pytest.mark.parametrize("numel", [640, 1000])
def test_round_trip_error_is_at_most_half_a_step(codec: BlockQuantCodec, numel: int) -> None:
    """Every decoded value is within half a quantization step (block amax / levels / 2)."""
    values = torch.randn(3, numel, generator=torch.Generator().manual_seed(0)) * 5
    values[1, :64] *= 1000  # one block of large values: its error is larger, the others' not
    _, decoded = _round_trip(codec, values)
    levels = 127 if codec.bits == 8 else 7
    bound = _block_amax(values, codec.block_size) / levels / 2
    assert bool(((decoded - values).abs() <= bound * (1 + 1e-6)).all())
    relative = (decoded - values).norm() / values.norm()
    assert relative < (0.01 if codec.bits == 8 else 0.2)


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
def test_block_maxima_and_multiples_of_the_step_survive_exactly(codec: BlockQuantCodec) -> None:
    """Values that are integer multiples of their block's step decode bitwise unchanged."""
    levels = 127 if codec.bits == 8 else 7
    codes = torch.randint(-levels, levels + 1, (2, 128), generator=torch.Generator().manual_seed(1))
    codes[:, 0] = levels  # each block holds its maximum
    codes[:, 64] = -levels
    step = torch.tensor([[0.5], [0.25]])
    values = codes.float() * step
    _, decoded = _round_trip(codec, values)
    assert torch.equal(decoded, values)


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
def test_decoding_is_the_same_for_every_rank_and_dtype(codec: BlockQuantCodec) -> None:
    """Decoding one encoding twice, or into bf16, gives the float32 values (cast)."""
    values = torch.randn(2, 200, generator=torch.Generator().manual_seed(2))
    encoded, decoded = _round_trip(codec, values)
    again = torch.empty(2, 200)
    codec.decode(encoded.clone(), again)
    assert torch.equal(again, decoded)
    low = torch.empty(2, 200, dtype=torch.bfloat16)
    codec.decode(encoded, low)
    assert torch.equal(low, decoded.to(torch.bfloat16))


def test_bf16_values_encode_like_their_float32_copy() -> None:
    """A bf16 input is quantized from its exact float32 values."""
    values = torch.randn(1, 300, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    encoded, _ = _round_trip(int8_codec(block_size=64), values)
    expected, _ = _round_trip(int8_codec(block_size=64), values.float())
    assert torch.equal(encoded, expected)


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
def test_residual_is_exactly_what_the_receivers_lose(codec: BlockQuantCodec) -> None:
    """With a residual: encode values + residual, and residual becomes (that sum - decoded)."""
    g = torch.Generator().manual_seed(4)
    values = torch.randn(2, 300, generator=g)
    residual = torch.randn(2, 300, generator=g) * 0.01
    target = values + residual
    _, decoded = _round_trip(codec, values, residual)
    assert torch.equal(residual, target - decoded)
    plain, _ = _round_trip(codec, target)
    with_feedback = torch.empty_like(plain)
    codec.encode(values, with_feedback, (target - values).clone())
    assert torch.equal(with_feedback, plain)


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
def test_error_feedback_keeps_the_accumulated_error_bounded(codec: BlockQuantCodec) -> None:
    """Over 300 steps, the sum of what was sent tracks the sum of the true values.

    Each block holds one large value, so a small steady component (0.01 per
    step, under half a step) rounds to zero every time: without feedback
    the accumulated error grows by 0.01 per step; with it the error stays
    the last residual, bounded by half a step (up to float32 rounding of
    the running ``values + residual``, about 1e-7 per step).
    """
    steps, numel = 300, 128
    g = torch.Generator().manual_seed(5)
    residual = torch.zeros(1, numel)
    sent_with = torch.zeros(1, numel, dtype=torch.float64)
    sent_without = torch.zeros(1, numel, dtype=torch.float64)
    truth = torch.zeros(1, numel, dtype=torch.float64)
    levels = 127 if codec.bits == 8 else 7
    half_step = 8.0 / levels / 2
    for _ in range(steps):
        values = torch.full((1, numel), 0.01) + torch.randn(1, numel, generator=g) * 1e-4
        values[0, ::64] = 8.0
        truth += values.double()
        _, decoded = _round_trip(codec, values, residual)
        sent_with += decoded.double()
        _, decoded = _round_trip(codec, values)
        sent_without += decoded.double()
        assert residual.abs().max() <= half_step * (1 + 1e-5)
    error_with = (sent_with - truth).abs().max().item()
    error_without = (sent_without - truth).abs().max().item()
    assert error_with <= half_step * (1 + 1e-3)
    torch.testing.assert_close(sent_with - truth, -residual.double(), atol=1e-6, rtol=0)
    assert error_without > 0.01 * steps * 0.9


def test_zero_blocks_decode_to_zero() -> None:
    """An all-zero block has scale 0 and decodes to zeros (no division by zero)."""
    values = torch.zeros(1, 128)
    values[0, 64:] = torch.arange(64.0)
    residual = torch.zeros(1, 128)
    _, decoded = _round_trip(int8_codec(block_size=64), values, residual)
    assert torch.equal(decoded[0, :64], torch.zeros(64))
    assert bool(torch.isfinite(decoded).all())
    assert bool(torch.isfinite(residual).all())


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
def test_non_finite_values_make_their_block_nan_and_leave_no_residual(
    codec: BlockQuantCodec,
) -> None:
    """A block with inf or NaN decodes to inf/NaN; its residual is zero, the other blocks' kept."""
    values = torch.ones(1, 192) * 0.3
    values[0, 5] = float("inf")
    values[0, 70] = float("nan")
    residual = torch.full((1, 192), 0.001)
    _, decoded = _round_trip(codec, values, residual)
    assert not bool(torch.isfinite(decoded[0, :128]).any())
    assert bool(torch.isfinite(decoded[0, 128:]).all())
    assert torch.equal(residual[0, :128], torch.zeros(128))
    assert bool(torch.isfinite(residual[0, 128:]).all())


def test_int4_packs_two_codes_per_byte() -> None:
    """Codes -7..7 pack low nibble first: [-7, 7] is one byte 1 | 15 << 4."""
    values = torch.zeros(1, 8)
    values[0, 0], values[0, 1] = -7.0, 7.0
    encoded, _ = _round_trip(BlockQuantCodec(4, 8), values)
    assert encoded[0, 0].item() == 1 | 15 << 4
    assert encoded[0, 1:4].tolist() == [8 | 8 << 4] * 3
    assert encoded[0, 4:].view(torch.float32).tolist() == [1.0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bits": 2}, r"^BlockQuantCodec: bits=2 is not supported; use 8 \(int8\) or 4 \(int4\)$"),
        (
            {"block_size": 0},
            r"^BlockQuantCodec: block_size must be a positive int, got 0; the default is 256$",
        ),
        (
            {"block_size": 100},
            r"^BlockQuantCodec: block_size=100 is not a multiple of 8; pick one that is "
            r"\(scales are 4-byte aligned, int4 codes pack in pairs\), e\.g\. 96$",
        ),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, int], message: str) -> None:
    """A width or block size the format cannot hold is a LayoutError saying what works."""
    with pytest.raises(LayoutError, match=message):
        BlockQuantCodec(**kwargs)


def test_encoded_buffer_of_the_wrong_size_is_refused() -> None:
    """encode names the shapes it got and the one it needs."""
    codec = int8_codec(block_size=64)
    with pytest.raises(
        LayoutError,
        match=r"^BlockQuantCodec\(bits=8, block_size=64\)\.encode: the encoded rows are "
        r"\(2, 10\) torch\.uint8, expected \(2, 68\) torch\.uint8 with contiguous rows "
        r"\(encoded_nbytes\(64\) bytes per row\)$",
    ):
        codec.encode(torch.zeros(2, 64), torch.empty(2, 10, dtype=torch.uint8))
    with pytest.raises(LayoutError, match=r"decode: out must be a 2-D floating point tensor"):
        codec.decode(torch.empty(1, 68, dtype=torch.uint8), torch.empty(64))
    with pytest.raises(LayoutError, match=r"encode: residual is \(1, 64\) torch\.float64"):
        codec.encode(
            torch.zeros(1, 64),
            torch.empty(1, 68, dtype=torch.uint8),
            torch.zeros(1, 64, dtype=torch.float64),
        )


def test_scratch_is_reused_per_thread_and_can_be_released() -> None:
    """On the CPU a codec keeps two float32 work buffers per thread, grown to the largest call."""
    codec = BlockQuantCodec(8, 64)
    codec.release_scratch()
    residual = torch.zeros(2, 100)
    _round_trip(codec, torch.randn(2, 100), residual)
    padded = 2 * 128
    assert codec.scratch_nbytes == 2 * padded * 4
    _round_trip(codec, torch.randn(1, 64), torch.zeros(1, 64))
    assert codec.scratch_nbytes == 2 * padded * 4
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(codec.scratch_nbytes))
    thread.start()
    thread.join()
    assert seen == [0]
    codec.release_scratch()
    assert codec.scratch_nbytes == 0


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
def test_tiny_blocks_are_sent_as_zeros_and_kept_in_the_residual(codec: BlockQuantCodec) -> None:
    """A block of denormal values (whose 1/amax overflows) decodes to zeros, never NaN.

    With error feedback the values stay in the residual: a block like this
    once turned a gradient's residual into NaN and a training run with it.
    """
    values = torch.full((1, 128), 0.5)
    values[0, :64] = torch.linspace(-3e-38, 3e-38, 64)
    residual = torch.zeros(1, 128)
    _, decoded = _round_trip(codec, values, residual)
    assert torch.equal(decoded[0, :64], torch.zeros(64))
    assert torch.equal(residual[0, :64], values[0, :64])
    assert torch.equal(decoded[0, 64:], values[0, 64:])
    _, decoded = _round_trip(codec, values * 1e7, residual)  # 3e-31: still below 1e-30
    assert bool(torch.isfinite(decoded).all())
    assert bool(torch.isfinite(residual).all())
