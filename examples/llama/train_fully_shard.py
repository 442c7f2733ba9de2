"""Train a Hugging Face Llama with shard's ``fully_shard``; checkpoint and export it.

Run it on two CPU ranks, or as one process::

    torchrun --nproc-per-node 2 examples/llama/train_fully_shard.py
    python examples/llama/train_fully_shard.py

The model is ``LlamaForCausalLM`` built from ``config.json`` beside this file
(64 wide, 2 layers, a byte vocabulary: a token is one byte of text). Each
decoder layer is one unit and the root (embeddings, final norm, head) is
another. The global batch is the same at any world size (each rank trains
its share of it), so two ranks print one process's losses. At the end the
script saves a resharding checkpoint (``--out``/checkpoint, loadable at any
world size with ``shard_checkpoint.load``) and exports the full weights to
``--out``/hf (``config.json`` and ``model.safetensors``), which
``transformers.AutoModelForCausalLM.from_pretrained`` loads as is.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

from shard_checkpoint import (
    export_full_state_dict,
    get_model_state_dict,
    get_optimizer_state_dict,
    save,
)
from shard_comms import init_distributed
from shard_runtime import fully_shard

HERE = Path(__file__).resolve().parent
TEXT = (
    "Fully sharded data parallel training keeps one slice of every parameter on each rank, "
    "gathers a layer's weights just before it runs and frees them right after. "
) * 8
GLOBAL_BATCH, SEQ = 4, 32
PROMPT = b"Fully sharded"


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step ``step``'s global batch: byte tokens and their next bytes."""
    data = torch.tensor(list(TEXT.encode()), dtype=torch.long)
    generator = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - SEQ - 1, (GLOBAL_BATCH,), generator=generator)
    rows = torch.stack([data[s : s + SEQ + 1] for s in starts.tolist()])
    share = GLOBAL_BATCH // world
    mine = rows[rank * share : (rank + 1) * share]
    return mine[:, :-1], mine[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", type=Path, default=Path("runs/examples/llama-fully-shard"))
    args = parser.parse_args()

    state = init_distributed()  # under torchrun; a world of one without it
    rank, world, device = state.rank, state.world_size, state.device
    if GLOBAL_BATCH % world:
        raise SystemExit(f"run on 1, 2 or 4 ranks: the global batch {GLOBAL_BATCH} is split")

    config = transformers.AutoConfig.from_pretrained(HERE)
    torch.manual_seed(0)  # every rank builds the same weights; fully_shard keeps its slice
    model = transformers.AutoModelForCausalLM.from_config(config).to(device)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)

    losses = []
    for step in range(1, args.steps + 1):
        x, y = (t.to(device) for t in batch(step, rank, world))
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        optim.step()
        optim.zero_grad()
        total = loss.detach()
        dist.all_reduce(total)  # the global batch's loss: the mean of the ranks' equal shares
        losses.append(total.item() / world)
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)

    save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)},
        checkpoint_id=args.out / "checkpoint",
    )
    hf_dir = args.out / "hf"
    if rank == 0:
        hf_dir.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(hf_dir)
    dist.barrier()
    export_full_state_dict(model, hf_dir / "model.safetensors")

    with torch.no_grad():  # what the exported model must reproduce
        prompt = torch.tensor([list(PROMPT)], device=device)
        logits = model(input_ids=prompt).logits.cpu()
    if rank == 0:
        torch.save({"prompt": prompt.cpu(), "logits": logits}, args.out / "logits.pt")
        (args.out / "losses.json").write_text(json.dumps(losses) + "\n", encoding="utf-8")
        print(f"checkpoint: {args.out / 'checkpoint'}; transformers model: {hf_dir}")
    # Every rank finishes before any tears down: a rank that leaves while gloo's worker
    # threads still hold its last collective can abort at interpreter exit.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
