"""torch.distributed.pipelining over stages sharded by shard's fully_shard, beside PyTorch's.

Pipelining drives each stage's FSDP itself (no gradient sync during the
micro-batches, then ``fully_shard.state(stage)``'s post-backward entry points
once): with ``use_shard_for_torch_fsdp`` active, called after pipelining was
imported (this module imports it first), shard's stages must train with
PyTorch's losses and parameters and reduce once per unit per step. 4 ranks:
2 pipeline stages x 2 data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from shard_comms import count_collectives
from shard_runtime import fully_shard
from shard_runtime.integrations import use_shard_for_torch_fsdp
from shard_testing import RankPool

_LAYERS = 4
_MICROBATCHES = 4
_STEPS = 2
_SCHEDULES = ("gpipe", "1f1b", "interleaved")


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def _stage_modules(pp_rank: int, interleaved: bool) -> list[tuple[int, nn.Sequential]]:
    """(stage index, module) of this pipeline rank: two layers, or one per virtual stage."""
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8) for _ in range(_LAYERS)]
    if interleaved:  # 4 virtual stages of one layer; this rank holds pp_rank and pp_rank + 2
        return [(index, nn.Sequential(layers[index])) for index in (pp_rank, pp_rank + 2)]
    return [(pp_rank, nn.Sequential(*layers[2 * pp_rank : 2 * pp_rank + 2]))]


def _train(
    schedule_name: str, shard_with: Callable[..., Any], dp_mesh: DeviceMesh, pp_mesh: DeviceMesh
) -> dict[str, Any]:
    interleaved = schedule_name == "interleaved"
    pp_rank = pp_mesh.get_local_rank()
    modules = _stage_modules(pp_rank, interleaved)
    num_stages = _LAYERS if interleaved else 2
    stages = []
    for index, module in modules:
        for layer in module:
            shard_with(layer, mesh=dp_mesh)
        shard_with(module, mesh=dp_mesh)
        stages.append(
            PipelineStage(module, index, num_stages, torch.device("cpu"), group=pp_mesh.get_group())
        )
    if interleaved:
        schedule: Any = ScheduleInterleaved1F1B(stages, _MICROBATCHES, loss_fn=_loss)
    else:
        kind = ScheduleGPipe if schedule_name == "gpipe" else Schedule1F1B
        schedule = kind(stages[0], _MICROBATCHES, loss_fn=_loss)
    params = [p for _, m in modules for p in m.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    g = torch.Generator().manual_seed(dp_mesh.get_local_rank())
    losses: list[list[float]] = []
    reduce_scatters: list[int] = []
    for _ in range(_STEPS):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
        step_losses: list[torch.Tensor] = []
        with count_collectives() as counts:
            if pp_rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=step_losses)
        reduce_scatters.append(counts.calls("reduce_scatter"))
        optimizer.step()
        optimizer.zero_grad()
        losses.append([float(loss.detach()) for loss in step_losses])
    return {
        "losses": losses,
        "params": [p.full_tensor().tolist() for p in params],
        "reduce_scatters": reduce_scatters,
        "units_with_params": sum(1 for _, m in modules for _ in m),
    }


def _pipeline(schedule_name: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    dp_mesh, pp_mesh = mesh["dp"], mesh["pp"]
    torch_result = _train(schedule_name, torch_fully_shard, dp_mesh, pp_mesh)
    with use_shard_for_torch_fsdp(late_bindings="ignore"):
        shard_result = _train(schedule_name, fully_shard, dp_mesh, pp_mesh)
    dist.barrier()
    return {"torch": torch_result, "shard": shard_result, "pp_rank": pp_mesh.get_local_rank()}


@pytest.mark.parametrize("schedule_name", _SCHEDULES)
def test_pipelined_fully_shard_matches_pytorch(rank_pool: RankPool, schedule_name: str) -> None:
    """PyTorch's losses and parameters under pipelining, and one reduction per unit per step."""
    for result in rank_pool.run(_pipeline, 4, schedule_name):
        torch_result, shard_result = result["torch"], result["shard"]
        assert shard_result["losses"] == torch_result["losses"]
        if result["pp_rank"] == 1:
            assert all(len(step) == _MICROBATCHES for step in shard_result["losses"])
        assert shard_result["params"] == torch_result["params"]
        units = shard_result["units_with_params"]
        assert shard_result["reduce_scatters"] == [units] * _STEPS


def test_fully_shard_state_of_a_module_that_is_not_sharded_names_it() -> None:
    """fully_shard.state, which pipelining calls, refuses a plain module with its class name."""
    with pytest.raises(ValueError, match=r"^fully_shard\.state: Linear is not sharded; pass a "):
        fully_shard.state(nn.Linear(2, 2))  # type: ignore[attr-defined]
