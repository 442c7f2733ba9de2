"""A small GPT-style decoder: the model ``shard train`` trains and ``shard plan`` sizes.

Why a model of our own: the ``shard train`` demo, ``shard plan`` and the
training benchmark (``tools/bench/bench_train.py``) need a transformer whose
sharding units are obvious and whose sizes are flags, and it must depend on
torch only so that the same file runs in a bare environment and under
PyTorch's FSDP for comparison.

Shape: token + learned position embedding, ``n_layers`` pre-LayerNorm blocks
(causal self-attention, then a GELU MLP, each on a residual branch), a final
LayerNorm and an untied output head. Each :class:`Block` owns its parameters
and nothing else, and the root owns only the embeddings, the final norm and
the head, so "shard every block, then the root" gives clean units.

[Note: deterministic data]
:func:`synthetic_tokens` draws every batch from a generator seeded by
``(seed, step)`` only, so every process, whatever its rank or world size,
can rebuild the same global batch and take its own slice of it; a
one-process run over the whole batch then sees exactly the data the ranks
see together. Each sequence follows ``x[t+1] = (x[t] + stride) % vocab`` with
a per-sequence stride, which attention can learn, so the loss falls visibly.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "MLP", "Block", "CausalSelfAttention", "GPTConfig", "synthetic_tokens"]


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a :class:`GPT`.

    Attributes:
        vocab_size: number of token ids (embedding rows and head outputs).
        d_model: width of the residual stream; must be divisible by ``n_heads``.
        n_heads: attention heads per block.
        n_layers: number of blocks.
        seq_len: longest sequence the position embedding covers.
        mlp_ratio: hidden width of the MLP as a multiple of ``d_model``.
    """

    vocab_size: int = 1024
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 4
    seq_len: int = 128
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        sizes = {
            "vocab_size": self.vocab_size,
            "d_model": self.d_model,
            "n_heads": self.n_heads,
            "n_layers": self.n_layers,
            "seq_len": self.seq_len,
            "mlp_ratio": self.mlp_ratio,
        }
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"GPTConfig: {name} must be at least 1, got {value}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                "pick a d_model that is a multiple of n_heads"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position ``t`` sees positions ``<= t`` only."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        heads = (batch, seq, self.n_heads, width // self.n_heads)
        q, k, v = (t.view(heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(batch, seq, width))
        return out


class MLP(nn.Module):
    """Position-wise feed-forward: widen, GELU, project back."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.fc = nn.Linear(config.d_model, hidden)
        self.proj = nn.Linear(hidden, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(F.gelu(self.fc(x)))
        return out


class Block(nn.Module):
    """One decoder block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """The decoder: ``tokens (batch, seq) -> logits (batch, seq, vocab_size)``.

    ``blocks`` is an ``nn.ModuleList`` of :class:`Block` (iterate it typed with
    :meth:`iter_blocks`); the root's own parameters are the embeddings, the
    final LayerNorm and the untied head.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters()

    def iter_blocks(self) -> Iterator[Block]:
        """The blocks in order, typed."""
        for block in self.blocks:
            assert isinstance(block, Block)
            yield block

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 style init: N(0, 0.02) weights, zero biases, residual outputs scaled down.

        The projections that write into the residual stream get
        ``0.02 / sqrt(2 * n_layers)`` so the stream's variance does not grow
        with depth. Draws from torch's global generator: seed it first for a
        reproducible model.
        """
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        for block in self.iter_blocks():
            nn.init.normal_(block.attn.proj.weight, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, std=residual_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(
                f"GPT: got sequences of {seq} tokens but seq_len={self.config.seq_len}; "
                "shorten the input or build the model with a larger seq_len"
            )
        positions = torch.arange(seq, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


def synthetic_tokens(config: GPTConfig, batch: int, *, seed: int, step: int) -> torch.Tensor:
    """The global batch of ``step``: ``(batch, seq_len + 1)`` int64 token ids.

    Inputs are ``[:, :-1]``, next-token targets ``[:, 1:]``. Depends on
    ``(seed, step)`` only; see [Note: deterministic data].
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    vocab = config.vocab_size
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, 8, (batch, 1), generator=generator)
    offsets = torch.arange(config.seq_len + 1).unsqueeze(0)
    return (start + stride * offsets) % vocab
