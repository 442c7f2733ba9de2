"""A comm codec small enough to check by hand, for tests of the encoded collectives.

shard-comms tests the collectives with it and shard-runtime the front ends'
``set_comm_codec``; shard-comm-quant's codecs are tested on their own.
"""

from __future__ import annotations

import torch

__all__ = ["HalfCodec"]


class HalfCodec:
    """Sends float16 (2 bytes a value); the residual is what float16 rounding lost."""

    def encoded_nbytes(self, numel: int) -> int:
        return 2 * numel

    def encode(
        self, values: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None
    ) -> None:
        target = values.to(torch.float32) + (0 if residual is None else residual)
        half = target.to(torch.float16)
        out.view(torch.float16).copy_(half)
        if residual is not None:
            residual.copy_(target - half.to(torch.float32))

    def decode(self, encoded: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(encoded.view(torch.float16))

    def __repr__(self) -> str:
        return "HalfCodec()"
