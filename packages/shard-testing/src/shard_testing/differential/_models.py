"""The model a :class:`~shard_testing.differential.Config` describes.

A token embedding, residual blocks, a final LayerNorm and a vocabulary head
(optionally tied to the embedding): small enough that a configuration runs
in well under a second on 2 CPU ranks, shaped like the models where FSDP's
corner cases live (frozen LoRA bases next to trainable adapters in one unit,
LayerNorm parameters of 8 or 16 elements that shard unevenly over 3 or 4
ranks, a weight shared by two modules, a branch some steps skip,
recomputation under activation checkpointing).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shard_testing.differential._config import BlockSpec, Config

__all__ = ["SEQUENCE", "VOCAB", "Block", "LoRALinear", "Net", "batch_of"]

VOCAB = 11
"""Vocabulary size: 11 rows shard unevenly over 2 and 4 ranks."""
SEQUENCE = 3
"""Tokens per sample."""
LORA_RANK = 2


class LoRALinear(nn.Module):
    """``base(x) + b(a(x))``: a frozen base Linear and a trainable low-rank pair.

    The pair lives in the same FSDP unit as the frozen base (the LoRA
    fine-tuning layout), so one unit holds parameters with and without
    gradients. ``b`` starts random (not zero, as LoRA usually starts it) so
    that ``a`` has a gradient from the first step.
    """

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.base = nn.Linear(dim_in, dim_out)
        self.base.requires_grad_(False)
        self.a = nn.Linear(dim_in, LORA_RANK, bias=False)
        self.b = nn.Linear(LORA_RANK, dim_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x) + self.b(self.a(x))
        return out


class Block(nn.Module):
    """``x + down(tanh(up(norm(x))))``, plus ``side(x)`` when the caller asks for it.

    ``use_side`` is a forward argument so that the side branch's parameters
    are used on some steps and not on others (their gradient is then ``None``
    or zero, and FSDP must treat them the same way PyTorch does).
    """

    def __init__(self, spec: BlockSpec, width: int, *, scaled: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up: nn.Module = (
            LoRALinear(width, 2 * width) if spec.kind == "lora" else nn.Linear(width, 2 * width)
        )
        self.down = nn.Linear(2 * width, width)
        self.side = nn.Linear(width, width) if spec.side else None
        self.inner_checkpoint = spec.checkpoint == "inner"
        self.scale: torch.Tensor | None
        if scaled:  # Config.buffers
            self.register_buffer("scale", torch.rand(width) + 0.5)
        else:
            self.scale = None

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.tanh(self.up(self.norm(x))))
        if self.scale is not None:
            out = out * self.scale.to(out.dtype)
        return out

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        if self.inner_checkpoint:
            body = checkpoint(self._body, x, use_reentrant=False)
            assert isinstance(body, torch.Tensor)
        else:
            body = self._body(x)
        out = x + body
        if self.side is not None and use_side:
            out = out + self.side(x)
        return out


class Net(nn.Module):
    """Embedding, ``config.blocks``, LayerNorm, head; logits of shape (batch, SEQUENCE, VOCAB).

    Built on the caller's RNG state: seed before constructing (both libraries
    must start from the same weights). LoRA bases are frozen here; the
    configuration's other frozen parameters are the runner's business.
    """

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, config.width)
        self.blocks = nn.ModuleList(
            Block(spec, config.width, scaled=config.buffers) for spec in config.blocks
        )
        self.norm = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, VOCAB, bias=False)
        if config.tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, use_side: bool) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, use_side)
        out: torch.Tensor = self.head(self.norm(h))
        return out


def batch_of(config: Config, step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, targets)`` of one rank's micro-batch: a function of the arguments only."""
    seed = ((config.seed * 1009 + step) * 101 + micro) * 1013 + rank
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(VOCAB, (config.batch, SEQUENCE), generator=generator)
    targets = torch.randint(VOCAB, (config.batch, SEQUENCE), generator=generator)
    return tokens, targets
