"""The codec on CUDA encodes and decodes bitwise as on the CPU (skipped without CUDA).

Every step of the codec is a correctly rounded float32 operation (max, min,
division, multiplication, rounding to nearest even), so a GPU must produce
the CPU's bytes; a rank on a GPU and one on a CPU would otherwise decode
different weights.
"""

from __future__ import annotations

import pytest
import torch

from shard_comm_quant import BlockQuantCodec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("bits", [8, 4])
def test_cuda_encoding_equals_the_cpu_one(bits: int) -> None:
    """Bytes, decoded values and residual are the CPU's, and no scratch is kept on CUDA."""
    codec = BlockQuantCodec(bits, 256)
    values = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    results = {}
    for device in ("cpu", "cuda"):
        rows = values.to(device)
        residual = torch.full_like(rows, 1e-3)
        encoded = torch.empty(3, codec.encoded_nbytes(1000), dtype=torch.uint8, device=device)
        codec.encode(rows, encoded, residual)
        decoded = torch.empty_like(rows)
        codec.decode(encoded, decoded)
        results[device] = (encoded.cpu(), decoded.cpu(), residual.cpu())
    for cpu, cuda in zip(results["cpu"], results["cuda"], strict=True):
        assert torch.equal(cpu, cuda)
