"""Block quantization of rows of values: int8 (or int4) codes and one float32 scale per block.

Each row is cut into blocks of ``block_size`` values (the last one padded
with zeros). A block's scale is its largest magnitude over the largest code
(127 for int8, 7 for int4), and each value travels as the nearest integer
multiple of the scale: symmetric absmax quantization, as ZeRO++ does for its
weight all-gather. An encoded row is the codes followed by the scales:

    int8: ``blocks * block_size`` bytes of codes, then ``4 * blocks`` of scales
    int4: ``blocks * block_size / 2`` bytes (two codes per byte), then the scales

so a row of ``n`` values costs ``n * (bits / 8 + 4 / block_size)`` bytes,
against ``4 n`` in float32 (``block_size`` 256: 0.254x for int8, 0.129x for
int4). Why 256: ``tools/bench/bench_codec.py`` and the plugin's README.

[Note: decoding is the same everywhere]
A value decodes as ``float32(code) * scale``, one correctly rounded float32
multiplication, so every rank that decodes a row gets bitwise the same
values, and the encoder, which keeps the rounded codes as float32, computes
exactly what the receivers will decode. That is what makes the error
feedback exact: the residual is the difference between what this rank meant
to send and what every receiver got, not an estimate of it.

[Note: one division everywhere]
The scale is ``amax / levels``. PyTorch divides a CUDA tensor by a Python
number as a multiplication by the number's float32 reciprocal (one more
rounding), while the CPU divides, so a scale computed as ``amax / 127``
differed in its last bit between a GPU and a CPU rank (and every code
scaled by it could differ: ``tests/test_codec_on_gpu.py`` caught it on the
first GPU run). Dividing by a 0-dim tensor is a true, correctly rounded
division on both. ``levels / amax`` is ``reciprocal(amax) * levels`` on both
devices (two correctly rounded operations), so it needs nothing.

[Note: tiny blocks]
A block's codes are its values times ``levels / amax``, which overflows to
infinity when ``amax`` is below about ``levels / 3.4e38`` (float32's largest
value): a gradient block of denormal values then turned into NaNs, and with
error feedback into a NaN residual that poisoned every later step (a
1000-step ``shard train`` diverged at step 39). A block whose largest
magnitude is below ``_TINY`` (1e-30) is therefore sent as zeros with scale
0; with error feedback its values stay in the residual until they matter.

[Note: non-finite values]
A block holding an infinity or a NaN has a non-finite scale, so every value
of it decodes to an infinity or a NaN on every rank (a loss scaler then
skips the step, as it would without quantization). Its residual is set to
zero rather than NaN, so one bad step does not poison every later one.

[Note: scratch buffers]
Encoding needs two float32 working buffers the size of what it encodes
(the values plus residual, and the scaled codes), decoding one when it
cannot write into its output directly. A fresh CPU allocation of a few
MiB is page-faulted in on every use, which costs more than the
quantization itself (``tools/bench/bench_codec.py``), so on the CPU each
thread keeps its two buffers, grown to the largest call, and reuses them;
``scratch_nbytes`` reports them and ``release_scratch()`` frees them. Off
the CPU the caching allocator recycles memory per stream, and reuse could
race with work still queued, so nothing is kept. This is the only state a
codec has, and it is per thread: one codec serves every unit and thread.
"""

from __future__ import annotations

import threading

import torch

from shard_core.errors import LayoutError

__all__ = ["BlockQuantCodec", "int4_codec", "int8_codec"]

DEFAULT_BLOCK_SIZE = 256
"""Values per scale; chosen by ``tools/bench/bench_codec.py`` (see the README)."""

_LEVELS = {8: 127, 4: 7}  # the largest code of each width; codes are symmetric around 0
_TINY = 1e-30  # blocks below are sent as zeros; see [Note: tiny blocks]


class _Scratch(threading.local):
    """The calling thread's float32 working buffers on the CPU, by slot (0 and 1)."""

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}


class BlockQuantCodec:
    """A :class:`~shard_core.protocols.CommCodec`: blockwise absmax quantization to int8 or int4.

    Stateless: one object serves every unit and thread (the error-feedback
    residual is the caller's). See the module docstring for the format.

    Attributes:
        bits: 8 or 4, the width of a code.
        block_size: Values per scale, a positive multiple of 8 (so scales stay
            4-byte aligned and int4 codes pack into whole bytes).
    """

    __slots__ = ("_levels", "_scratch", "bits", "block_size")

    def __init__(self, bits: int = 8, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if bits not in _LEVELS:
            raise LayoutError(
                f"BlockQuantCodec: bits={bits!r} is not supported; use 8 (int8) or 4 (int4)"
            )
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise LayoutError(
                f"BlockQuantCodec: block_size must be a positive int, got {block_size!r}; "
                f"the default is {DEFAULT_BLOCK_SIZE}"
            )
        if block_size % 8:
            raise LayoutError(
                f"BlockQuantCodec: block_size={block_size} is not a multiple of 8; pick one "
                f"that is (scales are 4-byte aligned, int4 codes pack in pairs), e.g. "
                f"{max(8, block_size // 8 * 8)}"
            )
        self.bits = bits
        self.block_size = block_size
        self._levels = _LEVELS[bits]
        self._scratch = _Scratch()

    def __repr__(self) -> str:
        return f"BlockQuantCodec(bits={self.bits}, block_size={self.block_size})"

    # - the CommCodec protocol

    def encoded_nbytes(self, numel: int) -> int:
        """Bytes of one encoded row of ``numel`` values: codes, then one float32 per block."""
        blocks = -(-numel // self.block_size)
        return blocks * (self._code_nbytes(self.block_size) + 4)

    def encode(
        self, values: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None
    ) -> None:
        """Quantize each row of ``values`` into ``out``; see ``protocols.CommCodec``."""
        rows, numel = self._check(values, out, "encode", "values")
        if residual is not None and (
            residual.shape != values.shape or residual.dtype != torch.float32
        ):
            raise LayoutError(
                f"{self!r}.encode: residual is {tuple(residual.shape)} {residual.dtype}, "
                f"values are {tuple(values.shape)}; pass a float32 residual of the values' shape"
            )
        blocks = -(-numel // self.block_size)
        codes, scales = self._split(out, rows, blocks)
        if residual is None and values.dtype == torch.float32 and values.stride(-1) == 1:
            # Read in place: the whole blocks as a view, the last partial one padded apart.
            # See [Note: scratch buffers].
            for segment, first, count in self._segments(values, rows, numel):
                self._quantize(segment, codes, scales, first, count)
            return
        x = self._working_copy(values, residual, blocks)  # (rows, blocks, block_size) float32
        rounded, scale = self._quantize(x, codes, scales, 0, blocks)
        if residual is not None:
            # See [Note: decoding is the same everywhere] and [Note: non-finite values];
            # x is this thread's scratch here, never the caller's values.
            rounded.mul_(scale.unsqueeze(-1))
            padded = blocks * self.block_size
            direct = numel == padded and residual.is_contiguous()
            lost = residual.view(x.shape) if direct else x
            torch.sub(x, rounded, out=lost)
            lost.masked_fill_(~torch.isfinite(scale).unsqueeze(-1), 0.0)
            if not direct:
                residual.copy_(lost.view(rows, padded)[:, :numel])

    def _quantize(
        self,
        x: torch.Tensor,
        codes: torch.Tensor,
        scales: torch.Tensor,
        first: int,
        count: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode ``x`` (``(rows, count, block_size)`` float32) as blocks ``first..first+count``.

        Returns the codes as float32 (in scratch slot 1) and the scales.
        """
        rows = x.shape[0]
        work = self._buffer(1, x.numel(), x.device).view(x.shape)
        # max |x| as max(max x, -min x): two read-only passes, no |x| written (3x faster)
        amax = torch.maximum(x.amax(dim=-1), x.amin(dim=-1).neg_())  # (rows, count)
        # See [Note: tiny blocks]; NaN and inf compare False and keep their scale.
        tiny = amax < _TINY
        # A tensor divisor, not a Python number: see [Note: one division everywhere].
        scale = torch.where(tiny, 0.0, amax / amax.new_full((), float(self._levels)))
        inverse = torch.where(tiny, 0.0, self._levels / amax)
        rounded = torch.mul(x, inverse.unsqueeze(-1), out=work)
        rounded.round_()  # now exactly the codes, as float32
        scales[:, first : first + count].copy_(scale)
        code_block = self._code_nbytes(self.block_size)
        target = codes[:, first * code_block : (first + count) * code_block]
        if self.bits == 8:
            target.view(torch.int8).view(rows, count, self.block_size).copy_(rounded)
        else:
            _pack_int4(rounded, target.view(rows, count, code_block))
        return rounded, scale

    def _segments(
        self, values: torch.Tensor, rows: int, numel: int
    ) -> list[tuple[torch.Tensor, int, int]]:
        """``(blocks of values, first block, block count)``: the whole blocks in place, then
        the last partial block copied into a zero-padded block of scratch slot 0."""
        full, rest = divmod(numel, self.block_size)
        segments = []
        if full:
            whole = values[:, : full * self.block_size].view(rows, full, self.block_size)
            segments.append((whole, 0, full))
        if rest:
            tail = self._buffer(0, rows * self.block_size, values.device)
            tail = tail.view(rows, 1, self.block_size)
            tail[:, 0, rest:] = 0.0
            tail[:, 0, :rest].copy_(values[:, full * self.block_size :])
            segments.append((tail, full, 1))
        return segments

    @property
    def scratch_nbytes(self) -> int:
        """Bytes of working buffers the calling thread keeps (CPU only; [Note: scratch buffers])."""
        return sum(b.numel() * b.element_size() for b in self._scratch.buffers.values())

    def release_scratch(self) -> None:
        """Free the calling thread's working buffers; the next call allocates again."""
        self._scratch.buffers.clear()

    def decode(self, encoded: torch.Tensor, out: torch.Tensor) -> None:
        """Dequantize each row of ``encoded`` into ``out``; see ``protocols.CommCodec``."""
        rows, numel = self._check(out, encoded, "decode", "out")
        blocks = -(-numel // self.block_size)
        codes, scales = self._split(encoded, rows, blocks)
        if out.dtype == torch.float32 and out.stride(-1) == 1:
            # Written in place: the whole blocks directly, the last partial one through scratch.
            full, rest = divmod(numel, self.block_size)
            if full:
                whole = out[:, : full * self.block_size].view(rows, full, self.block_size)
                self._dequantize(codes, scales, 0, whole)
            if rest:
                tail = self._buffer(0, rows * self.block_size, out.device)
                tail = tail.view(rows, 1, self.block_size)
                self._dequantize(codes, scales, full, tail)
                out[:, full * self.block_size :].copy_(tail[:, 0, :rest])
            return
        padded = blocks * self.block_size
        values = self._buffer(0, rows * padded, out.device).view(rows, blocks, self.block_size)
        self._dequantize(codes, scales, 0, values)
        out.copy_(values.view(rows, padded)[:, :numel])

    def _dequantize(
        self, codes: torch.Tensor, scales: torch.Tensor, first: int, out: torch.Tensor
    ) -> None:
        """Blocks ``first..`` of ``codes`` into ``out`` (float32 ``(rows, count, block_size)``)."""
        rows, count, _ = out.shape
        code_block = self._code_nbytes(self.block_size)
        source = codes[:, first * code_block : (first + count) * code_block]
        if self.bits == 8:
            out.copy_(source.view(torch.int8).view(rows, count, self.block_size))
        else:
            _unpack_int4(source.view(rows, count, code_block), out)
        out.mul_(scales[:, first : first + count].unsqueeze(-1))

    # - helpers

    def _code_nbytes(self, numel: int) -> int:
        return numel if self.bits == 8 else numel // 2

    def _split(
        self, encoded: torch.Tensor, rows: int, blocks: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes (uint8, ``(rows, code bytes)``) and scales (float32, ``(rows, blocks)``)."""
        code_nbytes = blocks * self._code_nbytes(self.block_size)
        codes = encoded[:, :code_nbytes]
        scales = encoded[:, code_nbytes:].view(torch.float32)
        return codes, scales

    def _working_copy(
        self, values: torch.Tensor, residual: torch.Tensor | None, blocks: int
    ) -> torch.Tensor:
        """``values (+ residual)`` as float32 ``(rows, blocks, block_size)``, zero padded.

        A view of ``values`` when nothing needs adding, casting or padding (it
        is then only read); scratch slot 0 otherwise.
        """
        rows, numel = values.shape
        padded = blocks * self.block_size
        if (
            residual is None
            and numel == padded
            and values.dtype == torch.float32
            and values.is_contiguous()
        ):
            return values.view(rows, blocks, self.block_size)
        x = self._buffer(0, rows * padded, values.device).view(rows, padded)
        if numel < padded:
            x[:, numel:] = 0.0
        if residual is None:
            x[:, :numel].copy_(values)
        else:
            torch.add(values, residual, out=x[:, :numel])
        return x.view(rows, blocks, self.block_size)

    def _buffer(self, slot: int, numel: int, device: torch.device) -> torch.Tensor:
        """``numel`` float32 of scratch ``slot``; see [Note: scratch buffers]."""
        if device.type != "cpu":
            return torch.empty(numel, dtype=torch.float32, device=device)
        buffer = self._scratch.buffers.get(slot)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=torch.float32)
            self._scratch.buffers[slot] = buffer
        return buffer[:numel]

    def _check(
        self, values: torch.Tensor, encoded: torch.Tensor, method: str, name: str
    ) -> tuple[int, int]:
        if values.dim() != 2 or not values.is_floating_point():
            raise LayoutError(
                f"{self!r}.{method}: {name} must be a 2-D floating point tensor (rows, values), "
                f"got {tuple(values.shape)} {values.dtype}"
            )
        rows, numel = values.shape
        expected = (rows, self.encoded_nbytes(numel))
        if (
            encoded.dtype != torch.uint8
            or tuple(encoded.shape) != expected
            or encoded.stride(-1) != 1
        ):
            raise LayoutError(
                f"{self!r}.{method}: the encoded rows are {tuple(encoded.shape)} {encoded.dtype}, "
                f"expected {expected} torch.uint8 with contiguous rows "
                f"(encoded_nbytes({numel}) bytes per row)"
            )
        return rows, numel


def _pack_int4(codes: torch.Tensor, out: torch.Tensor) -> None:
    """Pack float32 codes in [-7, 7] two per byte (low nibble first) into ``out``."""
    nibbles = (codes + 8).to(torch.uint8).view(*out.shape, 2)
    torch.bitwise_or(nibbles[..., 0], nibbles[..., 1] << 4, out=out)


def _unpack_int4(packed: torch.Tensor, out: torch.Tensor) -> None:
    """The float32 codes of ``packed`` (see :func:`_pack_int4`) into ``out``."""
    pairs = out.view(*packed.shape, 2)
    pairs[..., 0].copy_(packed & 0x0F)
    pairs[..., 1].copy_(packed >> 4)
    out.sub_(8)


def int8_codec(*, block_size: int = DEFAULT_BLOCK_SIZE) -> BlockQuantCodec:
    """The codec registered as ``"int8"``: int8 codes, one float32 scale per ``block_size``."""
    return BlockQuantCodec(8, block_size)


def int4_codec(*, block_size: int = DEFAULT_BLOCK_SIZE) -> BlockQuantCodec:
    """The codec registered as ``"int4"``: int4 codes (two per byte), one scale per block."""
    return BlockQuantCodec(4, block_size)
