"""A model of your own for ``shard train --model tiny_lm:build`` (run from this directory).

Any callable returning an ``nn.Module`` whose forward maps token ids
``(batch, seq)`` to logits ``(batch, seq, vocab)`` will do. The repeated
``Block`` layers become the sharded units (``--wrap-policy auto`` finds them).
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 256
"""One token per byte, so any UTF-8 text file is valid data."""


class Block(nn.Module):
    """A pre-norm residual MLP block: the unit shard gathers and frees as one."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, a stack of blocks, and a vocabulary projection."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build() -> nn.Module:
    """The factory ``--model tiny_lm:build`` calls."""
    return TinyLM()
