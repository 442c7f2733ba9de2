"""Lightning Fabric's ModelParallelStrategy on shard: train, checkpoint, resume.

Run on two CPU ranks (gloo)::

    torchrun --nproc-per-node 2 examples/frameworks/fabric_model_parallel.py --impl shard

``--impl torch`` runs PyTorch's ``fully_shard``; ``--impl shard`` the same
script after ``use_shard_for_torch_fsdp()`` (the only change); ``--impl both``
one after the other. Each step accumulates two micro-batches, the first under
``fabric.no_backward_sync``; halfway the run saves a checkpoint with
``fabric.save``, and a fresh model (built on the meta device,
``fabric.init_module(empty_init=True)``) and optimizer resume from it with
``fabric.load``. Rank 0 prints (and ``--out`` writes) per step: the two
micro-batch losses, the gradient reductions each backward dispatched, and the
losses of the resumed run.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import _common
import torch
import torch.distributed.fsdp as torch_fsdp
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def parallelize(model: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    """Fabric's ``parallelize_fn``: one unit per block, then the root.

    ``torch_fsdp.fully_shard`` is read when called, so it is shard's under
    ``use_shard_for_torch_fsdp()`` and PyTorch's otherwise.
    """
    mesh = device_mesh["data_parallel"]
    assert isinstance(model, _common.TinyModel)
    for layer in model.layers:
        torch_fsdp.fully_shard(layer, mesh=mesh)
    torch_fsdp.fully_shard(model, mesh=mesh)
    return model


def setup(fabric: Fabric, *, empty_init: bool = False) -> tuple[Any, Any, bool]:
    """Model, optimizer, and whether the model was built on the meta device.

    With ``empty_init`` Fabric builds the model on the meta device and
    materializes it after ``parallelize_fn`` sharded it.
    """
    with fabric.init_module(empty_init=empty_init):
        model = _common.build_model()
    on_meta = all(p.is_meta for p in model.parameters())
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, optimizer, on_meta


def train_steps(
    fabric: Fabric, model: Any, optimizer: Any, first: int, last: int
) -> list[dict[str, Any]]:
    records = []
    for step in range(first, last):
        losses, reductions = [], []
        for micro in range(2):
            x, y = _common.batch(step, micro, fabric.global_rank)
            with fabric.no_backward_sync(model, enabled=micro == 0):
                loss = nn.functional.mse_loss(model(x), y)
                counter = _common.CollectiveCounter()
                with counter:
                    fabric.backward(loss)
            losses.append(loss.item())
            reductions.append(counter.reductions)
        optimizer.step()
        optimizer.zero_grad()
        records.append({"step": step, "losses": losses, "reductions": reductions})
    return records


def train(impl: str, steps: int, workdir: Path) -> dict[str, Any]:
    fabric = Fabric(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(
            parallelize_fn=parallelize, data_parallel_size=2, tensor_parallel_size=1
        ),
    )
    fabric.launch()
    checkpoint = workdir / f"fabric-{impl}"
    if fabric.global_rank == 0:
        shutil.rmtree(checkpoint, ignore_errors=True)
    fabric.barrier()
    model, optimizer, _ = setup(fabric)
    half = steps // 2
    records = train_steps(fabric, model, optimizer, 0, half)
    fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "step": half})
    records += train_steps(fabric, model, optimizer, half, steps)

    # Resume into a model built on the meta device: fabric.load fills every shard.
    model, optimizer, resumed_on_meta = setup(fabric, empty_init=True)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(checkpoint, state)
    resumed = train_steps(fabric, model, optimizer, state["step"], steps)
    return {
        "fsdp_module": f"{torch_fsdp.FSDPModule.__module__}.{torch_fsdp.FSDPModule.__name__}",
        "model_class": f"{type(model.module).__module__}.{type(model.module).__name__}",
        "sharded_by_selected": isinstance(model.module, torch_fsdp.FSDPModule),
        "steps": records,
        "resumed": resumed,
        "resumed_on_meta": resumed_on_meta,
    }


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0])
    results = _common.run_each(args.impl, lambda impl: train(impl, args.steps, args.workdir))
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    _common.dump(args.out, results, rank)


if __name__ == "__main__":
    main()
