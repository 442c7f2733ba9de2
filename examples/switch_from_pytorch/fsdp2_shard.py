"""A PyTorch FSDP2 training script, twice: fsdp2_pytorch.py and fsdp2_shard.py differ by imports.

Run either on two CPU ranks, or as one process::

    torchrun --nproc-per-node 2 examples/switch_from_pytorch/fsdp2_pytorch.py
    torchrun --nproc-per-node 2 examples/switch_from_pytorch/fsdp2_shard.py
    python examples/switch_from_pytorch/fsdp2_shard.py

A small transformer language model, each block one ``fully_shard`` unit and
the root another, trains a few AdamW steps with gradient clipping; then the
model and optimizer state dicts (sharded, as DTensors) are saved with
``torch.distributed.checkpoint``. Everything but the import lines is plain
PyTorch, which is the point: switching from PyTorch's FSDP2 to shard is a
change of the lines that import ``fully_shard`` and the state-dict functions.
Both print the same losses, step by step.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

# isort: split
# The two files differ only here: PyTorch's FSDP2 and state dicts, or shard's.
from shard_checkpoint import get_model_state_dict, get_optimizer_state_dict
from shard_runtime import fully_shard

VOCAB, DIM, HEADS, LAYERS, SEQ, GLOBAL_BATCH = 64, 32, 4, 3, 16, 8


class Block(nn.Module):
    """Pre-norm self-attention and MLP, causal."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class LanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def init() -> tuple[int, int, torch.device]:
    """Join the torchrun job, or make a world of one when run with plain ``python``."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", "29533")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def main() -> None:
    parser = argparse.ArgumentParser(description="FSDP2 training, PyTorch's or shard's")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("runs/examples/switch"))
    args = parser.parse_args()
    rank, world, device = init()
    if GLOBAL_BATCH % world:
        raise SystemExit(f"run on 1, 2, 4 or 8 ranks: the global batch {GLOBAL_BATCH} is split")

    torch.manual_seed(0)  # every rank builds the same model; fully_shard keeps its slice
    model = LanguageModel().to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

    losses = []
    for step in range(1, args.steps + 1):
        generator = torch.Generator().manual_seed(step)  # sequences counting up in threes
        starts = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=generator)
        tokens = (starts + 3 * torch.arange(SEQ + 1)) % VOCAB
        share = GLOBAL_BATCH // world
        mine = tokens[rank * share : (rank + 1) * share].to(device)
        logits = model(mine[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), mine[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
        total = loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f}", flush=True)

    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim),
    }
    dcp.save(state, checkpoint_id=args.out / "checkpoint")
    if rank == 0:
        (args.out / "losses.json").write_text(json.dumps(losses) + "\n", encoding="utf-8")
    # Every rank finishes before any tears down: a rank that leaves while gloo's worker
    # threads still hold its last collective can abort at interpreter exit.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
