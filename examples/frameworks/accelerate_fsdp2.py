"""Hugging Face accelerate's FSDP2 plugin on shard: train, save_state, load_state.

Run on two CPU ranks (gloo)::

    torchrun --nproc-per-node 2 examples/frameworks/accelerate_fsdp2.py --impl shard

``--impl torch`` runs PyTorch's ``fully_shard``; ``--impl shard`` the same
script after ``use_shard_for_torch_fsdp()`` (the only change); ``--impl both``
one after the other. accelerate wraps each ``Block`` (its
``transformer_based_wrap`` policy) and the root with ``fully_shard``;
halfway the run saves with ``accelerator.save_state``, and a fresh model and
optimizer resume from it with ``accelerator.load_state``. Rank 0 prints (and
``--out`` writes) the per-step losses of both runs.

accelerate takes its FSDP path only on accelerators; on CPU
``_cpu_shims.force_accelerate_fsdp`` sends it there (see that file).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import _common
import _cpu_shims
import torch
import torch.distributed.fsdp as torch_fsdp
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import FullyShardedDataParallelPlugin
from torch import nn


def prepare(accelerator: Accelerator) -> tuple[Any, Any]:
    model = _common.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return accelerator.prepare(model, optimizer)  # type: ignore[no-any-return]


def train_steps(
    accelerator: Accelerator, model: Any, optimizer: Any, first: int, last: int
) -> list[float]:
    losses = []
    for step in range(first, last):
        x, y = _common.batch(step, 0, accelerator.process_index)
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def train(impl: str, steps: int, workdir: Path) -> dict[str, Any]:
    # The plugin reads torch.distributed.fsdp's names when built: build it after the switch.
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
        state_dict_type="SHARDED_STATE_DICT",
    )
    # accelerate keeps one state per process; --impl both builds a second Accelerator.
    AcceleratorState._reset_state(reset_partial_state=False)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    _cpu_shims.force_accelerate_fsdp(accelerator, plugin)
    checkpoint = workdir / f"accelerate-{impl}"
    if accelerator.is_main_process:
        shutil.rmtree(checkpoint, ignore_errors=True)
    accelerator.wait_for_everyone()
    model, optimizer = prepare(accelerator)
    half = steps // 2
    losses = train_steps(accelerator, model, optimizer, 0, half)
    accelerator.save_state(str(checkpoint))
    losses += train_steps(accelerator, model, optimizer, half, steps)

    accelerator.free_memory()
    model, optimizer = prepare(accelerator)
    accelerator.load_state(str(checkpoint))
    resumed = train_steps(accelerator, model, optimizer, half, steps)
    return {
        "model_class": f"{type(model).__module__}.{type(model).__name__}",
        "sharded_by_selected": isinstance(model, torch_fsdp.FSDPModule),
        "units": sum(isinstance(m, torch_fsdp.FSDPModule) for m in model.modules()),
        "losses": losses,
        "resumed": resumed,
    }


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0])
    results = _common.run_each(args.impl, lambda impl: train(impl, args.steps, args.workdir))
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    _common.dump(args.out, results, rank)


if __name__ == "__main__":
    main()
