"""flat_shard_placement: shards on the flattened storage, 1/N at any world size, same training."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from shard_runtime import flat_shard_placement, fully_shard
from shard_runtime._flat_placement import shard_numel
from shard_testing import RankPool, train_reference
from shard_testing.models import ToyNet, toy_batches, train_toy

STEPS = 3

# GPT-2 XL (d_model 1600, 48 blocks, vocab 50257, 1024 positions, untied head), nn.Linear shapes.
_D, _V, _S, _L = 1600, 50257, 1024, 48
_BLOCK = [
    *[(_D,)] * 2,  # ln1
    (3 * _D, _D),
    (3 * _D,),  # qkv
    (_D, _D),
    (_D,),  # attention proj
    *[(_D,)] * 2,  # ln2
    (4 * _D, _D),
    (4 * _D,),  # fc
    (_D, 4 * _D),
    (_D,),  # mlp proj
]
GPT2_XL_SHAPES = [(_V, _D), (_S, _D), (_D,), (_D,), (_V, _D), *_BLOCK * _L]


def _per_rank_ratio(world: int, *, flat: bool) -> float:
    full = sum(math.prod(s) for s in GPT2_XL_SHAPES)
    held = sum(shard_numel(s, world, flat=flat) for s in GPT2_XL_SHAPES)
    return held / (full / world)


def test_flat_layout_holds_every_rank_within_0_1_percent_of_ideal_at_1024_ranks() -> None:
    """GPT-2 XL at 1024 ranks: flat shards, padding included, stay within 0.1% of full/N."""
    assert _per_rank_ratio(1024, flat=False) > 1.15  # dim-0 rows: the waste being fixed
    assert _per_rank_ratio(1024, flat=True) < 1.001
    assert _per_rank_ratio(64, flat=True) == 1.0


def _train(config: dict[str, Any]) -> dict[str, Any]:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = ToyNet()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, shard_placement_fn=flat_shard_placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=flat_shard_placement)
    layout = {}
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor)
        local = param.to_local()
        layout[name] = (tuple(param.shape), tuple(param.placements), local.numel())
    losses = train_toy(model, STEPS)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {"losses": losses, "state": full, "layout": layout}


def _reference(world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    run = train_reference(
        model_factory=ToyNet,
        optimizer_factory=lambda params: torch.optim.AdamW(params, lr=0.05),
        loss_fn=nn.functional.mse_loss,
        batches=[step[0] for step in toy_batches(world, STEPS)],
    )
    return run.losses.tolist(), run.state_dict


@pytest.mark.parametrize("world", [3, 4])
def test_flat_shards_train_like_one_process(rank_pool: RankPool, world: int) -> None:
    """AdamW losses and final parameters equal one process's; uneven matrices are sharded flat."""
    ref_losses, ref_state = _reference(world)
    results = rank_pool.run(_train, world, {})
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses))
        assert list(result["state"]) == list(ref_state)
        for key, value in ref_state.items():
            got = result["state"][key]
            assert got.shape == value.shape, key
            torch.testing.assert_close(got, value, msg=lambda m, k=key: f"{k}: {m}")
    for rank, result in enumerate(results):
        for key, (shape, placements, local_numel) in result["layout"].items():
            full = ref_state[key].shape
            assert placements == (Shard(0),), key
            if len(full) >= 2 and full[0] % world != 0:  # flat: ceil(numel / world) elements
                assert shape == (full.numel(),), key
                per_rank = math.ceil(full.numel() / world)
                want = max(0, min(per_rank, full.numel() - rank * per_rank))
            else:  # dim 0 divides evenly, or 1-D: the default rows
                assert shape == tuple(full), key
                rows = math.ceil(full[0] / world)
                want = max(0, min(rows, full[0] - rank * rows)) * full[1:].numel()
            assert local_numel == want, (key, rank)


def _sharded_toy(seed: int) -> ToyNet:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = ToyNet(seed=seed)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, shard_placement_fn=flat_shard_placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=flat_shard_placement)
    return model


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def _save_flat(path: str) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    model = _sharded_toy(seed=7)
    dcp.save(model.state_dict(), checkpoint_id=path)
    return _full_state(model)


def _load_flat(path: str) -> dict[str, dict[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp

    model = _sharded_toy(seed=0)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)
    from_dcp = _full_state(model)
    # Plain full tensors: the flat parameters' load hook shards them (Shard(0) ones need DTensors).
    world = dist.get_world_size()
    full = {k: v for k, v in ToyNet(seed=11).state_dict().items() if _is_flat(v.shape, world)}
    model.load_state_dict(full, strict=False)
    return {"dcp": from_dcp, "full": _full_state(model)}


def _is_flat(shape: torch.Size, world: int) -> bool:
    return len(shape) >= 2 and shape[0] % world != 0


def test_flat_state_dict_keeps_full_shapes_and_reshards_from_4_to_3_ranks(
    rank_pool: RankPool, tmp_path: Any
) -> None:
    """DCP saved flat at 4 ranks loads at 3; keys and shapes are the unsharded model's."""
    path = str(tmp_path / "ckpt")
    saved = rank_pool.run(_save_flat, 4, path)[0]
    unsharded = ToyNet(seed=11).state_dict()
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in unsharded.items()}
    for loaded in rank_pool.run(_load_flat, 3, path):
        assert list(loaded["dcp"]) == list(unsharded)
        for key, value in saved.items():
            torch.testing.assert_close(loaded["dcp"][key], value, rtol=0, atol=0)
        flat = [k for k, v in unsharded.items() if _is_flat(v.shape, 3)]
        assert len(flat) == 4  # embed and the three outer weights (10 rows; 21 divides by 3)
        for key in flat:
            torch.testing.assert_close(loaded["full"][key], unsharded[key], rtol=0, atol=0)


def _checkpoint_api_round_trip(_: object) -> dict[str, Any]:
    from shard_checkpoint import StateDictOptions, get_model_state_dict, set_model_state_dict

    model = _sharded_toy(seed=0)
    full = StateDictOptions(full_state_dict=True, cpu_offload=False)
    sharded = {k: tuple(v.shape) for k, v in get_model_state_dict(model).items()}
    set_model_state_dict(model, ToyNet(seed=11).state_dict(), options=full)
    return {"sharded": sharded, "full": get_model_state_dict(model, options=full)}


def test_flat_shards_round_trip_through_shard_checkpoint_state_dicts(rank_pool: RankPool) -> None:
    """get/set_model_state_dict, sharded and full, see the unsharded names and full shapes."""
    unsharded = ToyNet(seed=11).state_dict()
    for result in rank_pool.run(_checkpoint_api_round_trip, 3, None):
        assert result["sharded"] == {k: tuple(v.shape) for k, v in unsharded.items()}
        assert list(result["full"]) == list(unsharded)
        for key, value in unsharded.items():
            torch.testing.assert_close(result["full"][key], value, rtol=0, atol=0)
