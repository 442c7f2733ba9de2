"""torchtitan's llama3 recipe on shard: its parallelize, loss scaling, grad clipping and checkpoint.

Run on two CPU ranks (gloo)::

    torchrun --nproc-per-node 2 examples/frameworks/torchtitan_llama3.py --impl shard

``--impl torch`` runs PyTorch's ``fully_shard``; ``--impl shard`` the same
script after ``use_shard_for_torch_fsdp()`` (the only change); ``--impl both``
one after the other. torchtitan is imported before the switch: its
``models/llama3/infra/parallelize.py`` binds ``fully_shard`` and
``FSDPModule`` at import time, and the integration rebinds them (torchtitan is
a known framework); without that, torchtitan's
``disable_fsdp_gradient_division`` skips shard's modules and gradients are
averaged where torchtitan sums them (grad norm half of PyTorch's).

The step is torchtitan's ``Trainer.train_step`` on a tiny llama3 with
random tokens (torchtitan's trainer wants a tokenizer and a dataset
download): ``parallelize_llama`` from a ``JobConfig`` (fp32, no activation
checkpointing, no compile), ``build_optimizers`` (AdamW), the loss summed and
divided by the global token count, ``dist_utils.clip_grad_norm_``. Halfway
the model and optimizer are saved with ``torch.distributed.checkpoint`` the
way torchtitan's ``CheckpointManager`` does (its ``ModelWrapper`` and the
``OptimizersContainer``, both ``Stateful``), and a fresh model and optimizer
resume from it. Rank 0 prints (and ``--out`` writes) per-step losses and grad
norms of both runs.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import _common
import _cpu_shims
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.fsdp as torch_fsdp

_cpu_shims.stub_torchtitan_moe_kernels()  # it imports triton (GPU kernels) at import time

import torchtitan.distributed.utils as dist_utils  # noqa: E402
from torchtitan.components.checkpoint import ModelWrapper  # noqa: E402
from torchtitan.components.optimizer import build_optimizers  # noqa: E402
from torchtitan.config import JobConfig  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.models.llama3 import Transformer, TransformerModelArgs, parallelize_llama  # noqa: E402

_cpu_shims.torchtitan_on_cpu()  # it asks for CUDA meshes when it finds no accelerator

VOCAB = 128
SEQ_LEN = 16


def job_config() -> JobConfig:
    config = JobConfig()
    config.parallelism.data_parallel_shard_degree = 2
    config.training.seq_len = SEQ_LEN
    config.training.mixed_precision_param = "float32"
    config.training.mixed_precision_reduce = "float32"
    config.training.max_norm = 1.0
    config.activation_checkpoint.mode = "none"
    config.compile.enable = False
    config.optimizer.name = "AdamW"
    config.optimizer.lr = 1e-2
    return config


def build(config: JobConfig, parallel_dims: ParallelDims) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    args = TransformerModelArgs(
        dim=32, n_layers=2, n_heads=4, vocab_size=VOCAB, multiple_of=16, max_seq_len=SEQ_LEN
    )
    model = Transformer(args)
    with torch.no_grad():  # as torchtitan's trainer calls it
        model.init_weights()
    model = parallelize_llama(model, parallel_dims, config)
    _cpu_shims.gloo_sum_reduction(model)  # PyTorch's FSDP2 would use PREMUL_SUM, gloo has none
    optimizers = build_optimizers([model], config.optimizer, parallel_dims)
    return model, optimizers


def train_steps(
    model: torch.nn.Module,
    optimizers: Any,
    config: JobConfig,
    parallel_dims: ParallelDims,
    first: int,
    last: int,
) -> list[dict[str, float]]:
    """torchtitan's ``Trainer.train_step``, one micro-batch per step."""
    records = []
    rank = dist.get_rank()
    for step in range(first, last):
        optimizers.zero_grad()
        generator = torch.Generator().manual_seed(100 * step + rank)
        tokens = torch.randint(0, VOCAB, (2, SEQ_LEN + 1), generator=generator)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        local_tokens = torch.tensor(labels.numel(), dtype=torch.int64)
        global_tokens = dist_utils.dist_sum(local_tokens, parallel_dims.get_mesh("batch"))
        logits = model(inputs)
        loss_sum = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), reduction="sum"
        )
        loss = loss_sum / global_tokens
        loss.backward()
        grad_norm = dist_utils.clip_grad_norm_(
            list(model.parameters()), config.training.max_norm, foreach=True
        )
        optimizers.step()
        global_loss = dist_utils.dist_sum(loss.detach(), parallel_dims.get_mesh("batch"))
        records.append({"loss": float(global_loss), "grad_norm": float(grad_norm)})
    return records


def train(impl: str, steps: int, workdir: Path) -> dict[str, Any]:
    config = job_config()
    parallel_dims = ParallelDims(
        dp_shard=2, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=dist.get_world_size()
    )
    parallel_dims.build_mesh()
    checkpoint = workdir / f"torchtitan-{impl}"
    if dist.get_rank() == 0:
        shutil.rmtree(checkpoint, ignore_errors=True)
    dist.barrier()
    model, optimizers = build(config, parallel_dims)
    half = steps // 2
    records = train_steps(model, optimizers, config, parallel_dims, 0, half)
    dcp.save({"model": ModelWrapper(model), "optimizer": optimizers}, checkpoint_id=str(checkpoint))
    records += train_steps(model, optimizers, config, parallel_dims, half, steps)

    model, optimizers = build(config, parallel_dims)
    dcp.load({"model": ModelWrapper(model), "optimizer": optimizers}, checkpoint_id=str(checkpoint))
    resumed = train_steps(model, optimizers, config, parallel_dims, half, steps)
    return {
        "model_class": f"{type(model).__module__}.{type(model).__name__}",
        "sharded_by_selected": isinstance(model, torch_fsdp.FSDPModule),
        "steps": records,
        "resumed": resumed,
    }


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0])
    dist.init_process_group("gloo")
    try:
        results = _common.run_each(args.impl, lambda impl: train(impl, args.steps, args.workdir))
        _common.dump(args.out, results, dist.get_rank())
        dist.barrier()  # every rank done before any tears down (see examples/llama)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
