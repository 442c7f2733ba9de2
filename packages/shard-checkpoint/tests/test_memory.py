"""Full state dicts cost a rank one full tensor at a time, never the full model.

The model is sixteen 1024x1024 fp32 linear layers (64 MiB, 4 MiB each) sharded
over 2 ranks (32 MiB of shards each), one unit per layer, by either front end.
A rank measures the growth of its peak resident set size during one call: rank
1 while gathering a rank-0-only full state dict, and while loading a full state
dict that only rank 0 holds (``broadcast_from_rank0``). Both must stay under
half the model's size; gathering a full state dict on every rank is the
control, which does grow by the whole model. Consolidating a checkpoint of the
model into one file, in one process, must stay under half the checkpoint's
size.

Peaks are measured by ``shard_testing.memory.PeakMeter``. The same call on a
tiny model runs first, so that one-time costs (lazy imports and caches, tens of
MiB in a fresh process) are not counted as the state dict's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from shard_checkpoint import (
    StateDictOptions,
    consolidate,
    get_model_state_dict,
    save,
    set_model_state_dict,
)
from shard_checkpoint._safetensors import read_safetensors
from shard_runtime import FullyShardedDataParallel as FSDP
from shard_runtime import ModuleWrapPolicy, fully_shard
from shard_testing import RankPool
from shard_testing.memory import MIB, PeakMeter, can_measure_peak
from shard_testing.models import LinearStack

LAYERS, WIDTH = 16, 1024
MODEL_BYTES = LAYERS * WIDTH * WIDTH * 4

pytestmark = pytest.mark.skipif(
    not can_measure_peak(),
    reason="needs Linux's clear_refs and glibc's mallopt to measure peak memory honestly",
)


def _sharded(front_end: str = "fully_shard", *, zeroed: bool = False) -> nn.Module:
    """The stack sharded per layer by ``fully_shard`` or by the wrapper (a unit per layer)."""
    model: nn.Module = LinearStack()
    if front_end == "wrapper":
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.layers:  # type: ignore[union-attr]
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if zeroed:
        with torch.no_grad(), FSDP.summon_full_params(model):
            for param in model.parameters():
                param.zero_()
    return model


def _tiny(front_end: str = "fully_shard") -> nn.Module:
    """A small sharded model to make each measured call on first.

    That first call pays the one-time costs (lazy imports, caches), which are
    no part of what a state dict costs.
    """
    model: nn.Module = nn.Sequential(nn.Linear(4, 4))
    if front_end == "wrapper":
        return FSDP(model)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return model


def _gather(cpu_offload: bool, front_end: str = "fully_shard") -> tuple[int, int]:
    model = _sharded(front_end)
    options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    get_model_state_dict(_tiny(front_end), options=options)
    meter = PeakMeter()
    meter.start()
    state = get_model_state_dict(model, options=options)
    growth = meter.growth()
    expected = LinearStack().state_dict()
    for key, value in state.items():
        assert torch.equal(value, expected[key]), key
    return growth, len(state)


def _broadcast_load(front_end: str) -> tuple[int, bool]:
    source: dict[str, Any] = LinearStack().state_dict() if dist.get_rank() == 0 else {}
    model = _sharded(front_end, zeroed=True)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    tiny = _tiny(front_end)
    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(tiny, get_model_state_dict(tiny, options=full), options=options)
    meter = PeakMeter()
    meter.start()
    set_model_state_dict(model, source, options=options)
    growth = meter.growth()
    loaded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    expected = LinearStack().state_dict()
    return growth, all(torch.equal(loaded[k], v) for k, v in expected.items())


@pytest.mark.parametrize("front_end", ["fully_shard", "wrapper"])
def test_rank0_only_full_state_dict_costs_other_ranks_one_tensor(
    rank_pool: RankPool, front_end: str
) -> None:
    """With cpu_offload, rank 1 gets {} and its peak grows by well under the model's size."""
    (_, rank0_keys), (growth, rank1_keys) = rank_pool.run(_gather, 2, True, front_end)
    assert (rank0_keys, rank1_keys) == (LAYERS, 0)
    print(
        f"rank-0-only full state dict ({front_end}): rank 1 peak +{growth / MIB:.1f} MiB "
        "(model 64 MiB)"
    )
    assert growth < MODEL_BYTES / 2


def test_full_state_dict_on_every_rank_costs_the_model(rank_pool: RankPool) -> None:
    """The control: without cpu_offload every rank keeps the full model, and the meter sees it."""
    for growth, keys in rank_pool.run(_gather, 2, False):
        assert keys == LAYERS
        assert growth > 0.9 * MODEL_BYTES


@pytest.mark.parametrize("front_end", ["fully_shard", "wrapper"])
def test_broadcast_from_rank0_costs_other_ranks_one_tensor(
    rank_pool: RankPool, front_end: str
) -> None:
    """Loading rank 0's full state dict grows rank 1's peak by well under the model's size."""
    results = rank_pool.run(_broadcast_load, 2, front_end)
    assert [loaded for _, loaded in results] == [True, True]
    growth = results[1][0]
    print(
        f"broadcast_from_rank0 load ({front_end}): rank 1 peak +{growth / MIB:.1f} MiB "
        "(model 64 MiB)"
    )
    assert growth < MODEL_BYTES / 2


def _save_stack(path: str) -> None:
    save({"model": get_model_state_dict(_sharded())}, checkpoint_id=path)


def _consolidate_measured(path: str, out: str, fmt: str) -> int:
    meter = PeakMeter()
    meter.start()
    consolidate(path, out, fmt=fmt, prefix="model.")  # type: ignore[arg-type]
    return meter.growth()


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_consolidate_costs_one_tensor_not_the_checkpoint(
    rank_pool: RankPool, tmp_path: Path, fmt: str
) -> None:
    """Consolidating a 2-rank checkpoint grows the peak by well under the checkpoint's size."""
    path, out = tmp_path / "ckpt", tmp_path / f"model.{fmt}"
    rank_pool.run(_save_stack, 2, str(path))
    size = sum(f.stat().st_size for f in path.iterdir())
    [growth] = rank_pool.run(_consolidate_measured, 1, str(path), str(out), fmt)
    print(f"consolidate ({fmt}): peak +{growth / MIB:.1f} MiB, checkpoint {size / MIB:.1f} MiB")
    assert growth < size / 2
    if fmt == "safetensors":
        tensors, _ = read_safetensors(out)
    else:
        tensors = torch.load(out, weights_only=True)
    expected = LinearStack().state_dict()
    assert list(tensors) == list(expected)
    for key, value in expected.items():
        assert torch.equal(tensors[key], value), key
