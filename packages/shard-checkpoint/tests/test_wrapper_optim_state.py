"""Optimizer state of ``FullyShardedDataParallel`` models: saved, moved, resumed exactly.

Every step uses one global batch of 12 rows cut into equal slices for 2 or 3
ranks, so runs at different world sizes see the same data. A run stops after
two AdamW steps and hands over model and optimizer state; a fresh model
(parameters zeroed, so nothing passes unless it is loaded) takes the third
step. The uninterrupted reference is a 2-rank run of the same recipe: at the
same world size and wrapping the resumed step is bit-identical, elsewhere it
matches within fp32 round-off (reductions are ordered differently).

Recipes: ``flat`` (a wrapper per block and one at the root,
``use_orig_params=False``), ``orig`` (the same, ``use_orig_params=True``),
``root`` (one wrapper for the whole model, ``use_orig_params=True``),
``fully_shard`` (per block and root), ``mixed`` (wrapped blocks under a
``fully_shard`` root).
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
    get_model_state_dict,
    get_optimizer_state_dict,
    load,
    save,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from shard_runtime import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    ModuleWrapPolicy,
    OptimStateKeyType,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
    fully_shard,
)
from shard_runtime import FullyShardedDataParallel as FSDP
from shard_testing import RankPool
from shard_testing.models import DIM_OUT, ResidualBlock, ToyNet, sharded_toy_net
from shard_testing.resume import (
    STEPS,
    Result,
    assert_resumed,
    resume_batches,
    train_step,
)

FULL = StateDictType.FULL_STATE_DICT
SHARDED = StateDictType.SHARDED_STATE_DICT
LOCAL = StateDictType.LOCAL_STATE_DICT


def _build(recipe: str, *, zeroed: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    model: nn.Module = ToyNet()
    per_block = ModuleWrapPolicy({ResidualBlock})
    if recipe in ("flat", "orig"):
        model = FSDP(model, auto_wrap_policy=per_block, use_orig_params=recipe == "orig")
    elif recipe == "root":
        model = FSDP(model, use_orig_params=True)
    elif recipe == "no_shard":  # original parameters keep their full shapes
        model = FSDP(
            model,
            auto_wrap_policy=per_block,
            use_orig_params=True,
            sharding_strategy=ShardingStrategy.NO_SHARD,
        )
    elif recipe == "hybrid":
        world = dist.get_world_size()
        model = FSDP(
            model,
            auto_wrap_policy=per_block,
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            device_mesh=init_device_mesh("cpu", (2, world // 2)),
        )
    elif recipe == "fully_shard":
        model = sharded_toy_net(fully_shard)
    elif recipe == "mixed":
        blocks = model.blocks  # type: ignore[union-attr]
        for i in range(len(blocks)):
            blocks[i] = FSDP(blocks[i], use_orig_params=True)
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    else:
        raise AssertionError(recipe)
    if zeroed:
        plain = {k: torch.zeros_like(v) for k, v in ToyNet().state_dict().items()}
        set_model_state_dict(model, plain, options=StateDictOptions(full_state_dict=True))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _finish(model: nn.Module, losses: list[float]) -> Result:
    return losses, get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _uninterrupted(recipe: str) -> Result:
    model, optim = _build(recipe)
    return _finish(model, [train_step(model, optim, s) for s in range(STEPS)])


# ------------------------------------------------------------------ sharded, through DCP


WRAPPER_API = ("flat", "orig", "root", "hybrid", "no_shard")  # the others use the functional API


def _save_sharded(recipe: str, path: str) -> None:
    model, optim = _build(recipe)
    for step in range(STEPS - 1):
        train_step(model, optim, step)
    if recipe in WRAPPER_API:
        with FSDP.state_dict_type(model, SHARDED, ShardedStateDictConfig()):
            state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
    else:
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optim),
        }
    save(state, checkpoint_id=path)


def _resume_sharded(recipe: str, path: str) -> Result:
    model, optim = _build(recipe, zeroed=True)
    if recipe not in WRAPPER_API:
        state: dict[str, Any] = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optim),
        }
        load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optim, state["optim"])
    else:
        with FSDP.state_dict_type(model, SHARDED):
            state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
            load(state, checkpoint_id=path)
            model.load_state_dict(state["model"])
            FSDP.optim_state_dict_to_load(model, optim, state["optim"], load_directly=True)
    return _finish(model, [train_step(model, optim, STEPS - 1)])


@pytest.mark.parametrize("recipe", ["flat", "orig"])
def test_sharded_resume_at_the_same_world_size_is_bit_identical(
    rank_pool: RankPool, tmp_path: Path, recipe: str
) -> None:
    """SHARDED model and optimizer state saved on 2 ranks, resumed on 2: step 3 is identical."""
    path = str(tmp_path / "ckpt")
    rank_pool.run(_save_sharded, 2, recipe, path)
    reference = rank_pool.run(_uninterrupted, 2, recipe)[0]
    for resumed in rank_pool.run(_resume_sharded, 2, recipe, path):
        assert_resumed(resumed, reference, exact=True)


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [
        ("flat", "root"),
        ("flat", "fully_shard"),
        ("fully_shard", "orig"),
        ("orig", "mixed"),
        ("no_shard", "orig"),
        ("orig", "no_shard"),
    ],
)
def test_sharded_resume_across_world_size_wrapping_and_front_end(
    rank_pool: RankPool, tmp_path: Path, saved: str, resumed: str
) -> None:
    """Saved on 2 ranks by one recipe, resumed on 3 by another: step 3 continues the run."""
    path = str(tmp_path / "ckpt")
    rank_pool.run(_save_sharded, 2, saved, path)
    reference = rank_pool.run(_uninterrupted, 2, saved)[0]
    for result in rank_pool.run(_resume_sharded, 3, resumed, path):
        assert_resumed(result, reference, exact=False)


def test_hybrid_wrapper_checkpoint_resumes_on_another_mesh(
    rank_pool: RankPool, tmp_path: Path
) -> None:
    """HYBRID_SHARD on a 2x2 mesh saves once per shard; resumed at 4 (hybrid) and 2 (flat)."""
    path = str(tmp_path / "ckpt")
    rank_pool.run(_save_sharded, 4, "hybrid", path)
    reference = rank_pool.run(_uninterrupted, 4, "hybrid")[0]
    for result in rank_pool.run(_resume_sharded, 4, "hybrid", path):
        assert_resumed(result, reference, exact=True)
    for result in rank_pool.run(_resume_sharded, 2, "flat", path):
        assert_resumed(result, reference, exact=False)


# ------------------------------------------------------------------ full, in memory


def _full_after_two(recipe: str) -> dict[str, Any]:
    model, optim = _build(recipe)
    for step in range(STEPS - 1):
        train_step(model, optim, step)
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, FULL, config):
        model_state = model.state_dict()
    return {"model": model_state, "optim": FSDP.full_optim_state_dict(model, optim)}


def _resume_full(recipe: str, state: dict[str, Any], how: str) -> Result:
    model, optim = _build(recipe, zeroed=True)
    full = state["optim"]
    if how == "scatter":
        model_state = state["model"]
        loadable = FSDP.scatter_full_optim_state_dict(
            full if dist.get_rank() == 0 else None, model, optim=optim
        )
    elif how == "shard":
        model_state = state["model"]
        loadable = FSDP.shard_full_optim_state_dict(full, model, optim=optim)
    elif how == "functional":  # broadcast_from_rank0: the rest pass nothing
        rank0 = dist.get_rank() == 0
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, state["model"] if rank0 else {}, options=options)
        set_optimizer_state_dict(model, optim, full if rank0 else {}, options=options)
        return _finish(model, [train_step(model, optim, STEPS - 1)])
    else:  # the optimizer config asks for rank 0 only: the rest pass nothing
        rank0 = dist.get_rank() == 0
        model_state = state["model"]
        config = FullOptimStateDictConfig(rank0_only=True)
        with FSDP.state_dict_type(model, FULL, FullStateDictConfig(), config):
            loadable = FSDP.optim_state_dict_to_load(model, optim, full if rank0 else {})
    set_model_state_dict(model, model_state, options=StateDictOptions(full_state_dict=True))
    optim.load_state_dict(loadable)
    return _finish(model, [train_step(model, optim, STEPS - 1)])


def test_full_optim_state_dict_is_on_rank0_keyed_by_name(rank_pool: RankPool) -> None:
    """full_optim_state_dict: every parameter's full AdamW state on rank 0's CPU; {} on rank 1."""
    rank0, rank1 = rank_pool.run(_full_after_two, 2, "flat")
    assert rank1 == {"model": {}, "optim": {}}
    plain = ToyNet()
    names = [name for name, _ in plain.named_parameters()]
    # The optimizer's order: the root unit's flat shard (embed, head), then each block's.
    names = [*names[:2], *names[-2:], *names[2:-2]]
    optim = rank0["optim"]
    assert list(optim["state"]) == names
    assert [group["params"] for group in optim["param_groups"]] == [names]
    for name, param in plain.named_parameters():
        state = optim["state"][name]
        # Elementwise state first, as PyTorch's FSDP1 unflattens a flat parameter's state.
        assert list(state) == ["exp_avg", "exp_avg_sq", "step"]
        assert state["step"].item() == 2.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].shape == param.shape
            assert state[key].device.type == "cpu"


@pytest.mark.parametrize("how", ["scatter", "shard", "rank0_config", "functional"])
def test_full_optim_state_dict_resumes_on_three_ranks(rank_pool: RankPool, how: str) -> None:
    """A full optimizer state dict loads at 3 ranks (scattered, sharded, or broadcast)."""
    # "functional": set_model_state_dict / set_optimizer_state_dict with broadcast_from_rank0.
    state = rank_pool.run(_full_after_two, 2, "orig")[0]
    reference = rank_pool.run(_uninterrupted, 2, "orig")[0]
    for result in rank_pool.run(_resume_full, 3, "flat", state, how):
        assert_resumed(result, reference, exact=False)


def _rekeyed(state: dict[str, Any]) -> dict[str, Any]:
    model, _ = _build("flat")
    by_id = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, model)
    # Positions mean the unwrapped model's parameter order both ways (no optimizer given:
    # the wrapped model's flat units list theirs in another order).
    back = FSDP.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, model)
    return {"by_id": by_id, "back": back}


def test_rekeyed_full_state_loads_into_a_plain_optimizer(rank_pool: RankPool) -> None:
    """PARAM_ID keys load into a plain AdamW over ToyNet; PARAM_NAME gives the original back
    (each param group's names sorted, as PyTorch lists them)."""
    state = rank_pool.run(_full_after_two, 2, "flat")[0]
    rekeyed = rank_pool.run(_rekeyed, 2, state["optim"])[0]
    plain = ToyNet()
    plain.load_state_dict(state["model"])
    optim = torch.optim.AdamW(plain.parameters(), lr=0.05, weight_decay=0.1)
    optim.load_state_dict(rekeyed["by_id"])
    loaded = optim.state_dict()
    names = [n for n, _ in plain.named_parameters()]
    # The state keeps the order it came in (the flat units'), as PyTorch's rekeying does.
    assert list(rekeyed["by_id"]["state"]) == [names.index(n) for n in state["optim"]["state"]]
    assert sorted(loaded["state"]) == list(range(len(names)))
    for index, name in enumerate(names):
        for key, value in state["optim"]["state"][name].items():
            assert torch.equal(loaded["state"][index][key], value), (name, key)
    assert list(rekeyed["back"]["state"]) == list(state["optim"]["state"])
    for name, entry in state["optim"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(rekeyed["back"]["state"][name][key], value), (name, key)
    assert rekeyed["back"]["param_groups"] == [
        {**group, "params": sorted(group["params"])} for group in state["optim"]["param_groups"]
    ]


# ------------------------------------------------------------------ mixed precision, LOCAL


class _WithBuffer(ToyNet):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((DIM_OUT,), 0.5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale.to(x.dtype)


def _mixed_precision_dtypes() -> dict[str, Any]:
    mp = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.float16)
    model = FSDP(
        _WithBuffer(), auto_wrap_policy=ModuleWrapPolicy({ResidualBlock}), mixed_precision=mp
    )
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    train_step(model, optim, 0)
    out: dict[str, Any] = {"live_buffer": model.scale.dtype}
    for kind in (FULL, SHARDED, LOCAL):
        with FSDP.state_dict_type(model, kind):
            out[kind.name] = {k: v.dtype for k, v in model.state_dict().items()}
    with FSDP.state_dict_type(model, FULL):
        optim_state = FSDP.optim_state_dict(model, optim)["state"]
        out["optim"] = {k: v["exp_avg"].dtype for k, v in optim_state.items()}
    return out


def test_mixed_precision_never_leaks_into_state_dicts(rank_pool: RankPool) -> None:
    """bf16 compute and fp16 buffers: FULL and SHARDED state dicts hold fp32 parameters and the
    fp64 buffer; LOCAL, what each rank holds, keeps the fp16 buffer (as PyTorch's does)."""
    keys = [*ToyNet().state_dict(), "scale"]
    for result in rank_pool.run(_mixed_precision_dtypes, 2):
        assert result["live_buffer"] == torch.float16
        for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
            dtypes = result[kind]
            assert sorted(dtypes) == sorted(keys)
            assert {k: v for k, v in dtypes.items() if k != "scale"} == dict.fromkeys(
                [k for k in keys if k != "scale"], torch.float32
            )
            assert dtypes["scale"] == torch.float64
        assert result["LOCAL_STATE_DICT"]["scale"] == torch.float16
        assert set(result["optim"].values()) == {torch.float32}


def _local_shards() -> dict[str, torch.Tensor]:
    model, _ = _build("orig")
    with FSDP.state_dict_type(model, LOCAL):
        return {k: v.to_local().clone() for k, v in model.state_dict().items()}


def _load_local(state: dict[str, torch.Tensor]) -> str:
    model, _ = _build("orig")
    with FSDP.state_dict_type(model, LOCAL):
        try:
            model.load_state_dict(state)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_local_shards_refuse_another_world_size(rank_pool: RankPool) -> None:
    """Rank 0's LOCAL shards from 2 ranks load at 2 and are refused at 3, naming the key."""
    state = rank_pool.run(_local_shards, 2)[0]
    assert list(state) == [
        "_flat_param",
        "blocks.0._flat_param",
        "blocks.1._flat_param",
        "blocks.2._flat_param",
    ]
    assert rank_pool.run(_load_local, 2, state) == ["loaded", "loaded"]
    for message in rank_pool.run(_load_local, 3, state):
        # The root unit: embed 60 + 10 (+2 to align), head 30 (+2) + 3 = 107 -> 54 or 36.
        assert message == (
            "StateDictError: '_flat_param' holds 54 elements, but this rank's shard of the unit "
            "holds 36 (3 ranks); a LOCAL state dict of plain tensors loads only at the world "
            "size and wrapping that wrote it: save FULL_STATE_DICT or SHARDED_STATE_DICT to "
            "load elsewhere"
        )


def _local_round_trip(path: str, write: bool) -> dict[str, torch.Tensor] | None:
    model, optim = _build("flat", zeroed=not write)
    if write:
        train_step(model, optim, 0)
    with FSDP.state_dict_type(model, LOCAL):
        state = {"model": model.state_dict()}
        if write:
            save(state, checkpoint_id=path)
            return None
        load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def test_local_state_dict_round_trips_through_a_checkpoint(
    rank_pool: RankPool, tmp_path: Path
) -> None:
    """LOCAL flat shards saved with save() load back into a fresh model at the same world size."""
    path = str(tmp_path / "local")
    rank_pool.run(_local_round_trip, 2, path, True)
    reference = _first_step_plain()
    for result in rank_pool.run(_local_round_trip, 2, path, False):
        assert result is not None
        assert list(result) == list(reference)
        for key, value in reference.items():
            torch.testing.assert_close(result[key], value, msg=lambda m, k=key: f"{k}: {m}")


def _first_step_plain() -> dict[str, torch.Tensor]:
    model = ToyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    x, y = resume_batches()[0]
    nn.functional.mse_loss(model(x), y).backward()
    optim.step()
    return {k: v.detach() for k, v in model.state_dict().items()}
