"""consolidate turns a multi-rank checkpoint into one file equal to the unsharded state dict.

Three ranks train ``ToyNet`` (uneven shards) for one step and save model and
AdamW state; this process, with no process group, consolidates the
checkpoint and compares the files with the full state dicts the ranks
gathered.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shard_checkpoint import (
    CheckpointError,
    StateDictOptions,
    consolidate,
    get_model_state_dict,
    get_optimizer_state_dict,
    save,
)
from shard_checkpoint._safetensors import read_safetensors
from shard_runtime import fully_shard
from shard_testing import RankPool
from shard_testing.models import sharded_toy_net, toy_batches

FULL = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)


def _train_and_save(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    model = sharded_toy_net(fully_shard)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    (x, y) = toy_batches(dist.get_world_size(), steps=1)[0][0][dist.get_rank()]
    nn.functional.mse_loss(model(x), y).backward()
    optim.step()
    save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)},
        checkpoint_id=path,
    )
    return (
        get_model_state_dict(model, options=FULL),
        get_optimizer_state_dict(model, optim, options=FULL),
    )


@pytest.fixture(scope="module")
def saved(
    rank_pool: RankPool, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, torch.Tensor], dict[str, Any]]:
    path = tmp_path_factory.mktemp("consolidate") / "ckpt"
    model, optim = rank_pool.run(_train_and_save, 3, str(path))[0]
    return path, model, optim


def _assert_equal(got: dict[str, Any], want: dict[str, Any], *, ordered: bool = True) -> None:
    assert list(got) == list(want) if ordered else sorted(got) == sorted(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def test_consolidated_safetensors_equal_the_unsharded_model(
    saved: tuple[Path, dict[str, torch.Tensor], dict[str, Any]], tmp_path: Path
) -> None:
    """prefix='model.' writes the model's full state dict, readable by safetensors too."""
    path, model, _ = saved
    out = consolidate(path, tmp_path / "model.safetensors", prefix="model.")
    tensors, metadata = read_safetensors(out)
    assert metadata == {"format": "pt"}
    _assert_equal(tensors, model)
    safetensors_torch = pytest.importorskip("safetensors.torch")
    _assert_equal(safetensors_torch.load_file(out), model)


def test_consolidated_torch_file_holds_model_and_optimizer(
    saved: tuple[Path, dict[str, torch.Tensor], dict[str, Any]], tmp_path: Path
) -> None:
    """fmt='torch' keeps every key, optimizer options included, and loads with weights_only."""
    path, model, optim = saved
    loaded = torch.load(consolidate(path, tmp_path / "all.pt", fmt="torch"), weights_only=True)
    assert loaded["optim.param_groups.0.lr"] == 0.1
    assert loaded["optim.param_groups.0.params"] == list(model)
    assert {k for k in loaded if k.startswith("optim.param_groups.")} == {
        f"optim.param_groups.0.{option}" for option in [*optim_options(optim), "params"]
    }
    _assert_equal({k[6:]: v for k, v in loaded.items() if k.startswith("model.")}, model)
    _assert_equal(
        {k[6:]: v for k, v in loaded.items() if k.startswith("optim.state.")},
        {k: v for k, v in optim.items() if k.startswith("state.")},
        ordered=False,  # DCP's metadata keeps its own order
    )


def optim_options(flat: dict[str, Any]) -> set[str]:
    """Option names of the flat optimizer state dict's groups."""
    return {k.rsplit(".", 1)[1] for k in flat if k.startswith("param_groups.")}


def test_consolidate_refuses_what_safetensors_cannot_hold(
    saved: tuple[Path, dict[str, torch.Tensor], dict[str, Any]], tmp_path: Path
) -> None:
    """safetensors output names the first non-tensor (an optimizer option); a bad prefix fails."""
    path, _, _ = saved
    with pytest.raises(CheckpointError) as caught:
        consolidate(path, tmp_path / "all.safetensors")
    assert re.fullmatch(
        r"consolidate: 'optim\.param_groups\.0\.\w+' in checkpoint .* is not a tensor, and "
        r"safetensors holds tensors only; pass a prefix that leaves it out \(e\.g\. "
        r"prefix='model\.'\) or fmt='torch'",
        str(caught.value),
    ), str(caught.value)
    with pytest.raises(
        CheckpointError,
        match=r"no key of checkpoint .* starts with 'modle\.'; its keys start with "
        r"\['model', 'optim'\]",
    ):
        consolidate(path, tmp_path / "x.safetensors", prefix="modle.")
