"""The wrapper's state-dict types: full, sharded and local, reached through the registry."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

from shard_core import make_plugin_manager, reset_plugin_manager
from shard_core.errors import UnknownPluginNameError
from shard_core.plugin import Registry
from shard_runtime import (
    FullStateDictConfig,
    LocalStateDictConfig,
    ModuleWrapPolicy,
    ShardedStateDictConfig,
    StateDictSettings,
    StateDictType,
)
from shard_runtime import FullyShardedDataParallel as FSDP
from shard_testing import RankPool
from shard_testing.models import ResidualBlock, ToyNet

PER_BLOCK = ModuleWrapPolicy({ResidualBlock})
FULL = StateDictType.FULL_STATE_DICT
SHARDED = StateDictType.SHARDED_STATE_DICT
LOCAL = StateDictType.LOCAL_STATE_DICT


def _plain(seed: int = 0) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ToyNet(seed=seed).state_dict().items()}


def _full(use_orig_params: bool) -> dict[str, Any]:
    model = FSDP(ToyNet(), auto_wrap_policy=PER_BLOCK, use_orig_params=use_orig_params)
    with FSDP.state_dict_type(model, FULL):
        full = model.state_dict()
    with FSDP.state_dict_type(model, FULL, FullStateDictConfig(True, rank0_only=True)):
        rank0_only = model.state_dict()
    return {
        "full": full,
        "rank0_only": {k: v.device.type for k, v in rank0_only.items()},
        "after": FSDP.get_state_dict_type(model).state_dict_type,
        "default_keys": list(model.state_dict()),
    }


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_full_state_dict_equals_the_plain_models(
    rank_pool: RankPool, use_orig_params: bool
) -> None:
    """FULL (the default) gives the plain model's keys and values on every rank; rank0_only: {}."""
    expected = _plain()
    rank0, rank1 = rank_pool.run(_full, 2, use_orig_params)
    for result in (rank0, rank1):
        assert list(result["full"]) == list(expected)
        for key, value in expected.items():
            torch.testing.assert_close(result["full"][key], value, rtol=0, atol=0)
        assert result["after"] is FULL  # PyTorch's default
        assert result["default_keys"] == list(expected)
    assert rank0["rank0_only"] == dict.fromkeys(expected, "cpu")
    assert rank1["rank0_only"] == {}


def _sharded(use_orig_params: bool) -> dict[str, Any]:
    model = FSDP(ToyNet(), auto_wrap_policy=PER_BLOCK, use_orig_params=use_orig_params)
    with FSDP.state_dict_type(model, SHARDED, ShardedStateDictConfig()):
        state = model.state_dict()
    return {
        k: (
            type(v).__name__,
            tuple(v.placements) if isinstance(v, DTensor) else (),
            v.to_local() if isinstance(v, DTensor) else v,
        )
        for k, v in state.items()
    }


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_sharded_state_dict_cuts_each_parameter_like_torch_chunk(
    rank_pool: RankPool, use_orig_params: bool
) -> None:
    """SHARDED: each parameter a Shard(0) DTensor holding its torch.chunk rows; buffers plain."""
    expected = _plain()
    params = dict(ToyNet().named_parameters())
    for rank, result in enumerate(rank_pool.run(_sharded, 2, use_orig_params)):
        assert list(result) == list(expected)
        for key, value in expected.items():
            kind, placements, local = result[key]
            if key in params:
                assert (kind, placements) == ("DTensor", (Shard(0),))
                chunks = torch.chunk(value, 2)
                want = chunks[rank] if rank < len(chunks) else value[:0]
                torch.testing.assert_close(local, want, rtol=0, atol=0)
            else:
                assert kind == "Tensor"


def _round_trip(use_orig_params: bool, kind: StateDictType) -> dict[str, Any]:
    source = FSDP(ToyNet(seed=0), auto_wrap_policy=PER_BLOCK, use_orig_params=use_orig_params)
    target = FSDP(ToyNet(seed=1), auto_wrap_policy=PER_BLOCK, use_orig_params=use_orig_params)
    with FSDP.state_dict_type(source, kind), FSDP.state_dict_type(target, kind):
        result = target.load_state_dict(source.state_dict())
    with FSDP.state_dict_type(target, FULL):
        full = target.state_dict()
    return {"full": full, "missing": result.missing_keys, "unexpected": result.unexpected_keys}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", [FULL, SHARDED, LOCAL], ids=["full", "sharded", "local"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_state_dict_loads_into_another_wrapped_model(
    rank_pool: RankPool, use_orig_params: bool, kind: StateDictType, world: int
) -> None:
    """Loading one model's FULL, SHARDED or LOCAL state dict into another makes it equal to the
    first, at 1 to 4 ranks."""
    expected = _plain(seed=0)
    assert not torch.equal(_plain(seed=1)["embed.weight"], expected["embed.weight"])
    for result in rank_pool.run(_round_trip, world, use_orig_params, kind):
        assert (result["missing"], result["unexpected"]) == ([], [])
        assert list(result["full"]) == list(expected)
        for key, value in expected.items():
            torch.testing.assert_close(result["full"][key], value, rtol=0, atol=0)


def _strict_error() -> str:
    model = FSDP(ToyNet(), auto_wrap_policy=PER_BLOCK)
    with FSDP.state_dict_type(model, FULL):
        state = model.state_dict()
        del state["head.bias"]
        try:
            model.load_state_dict(state)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_full_load_names_the_missing_key(rank_pool: RankPool) -> None:
    """A FULL state dict lacking a parameter is refused under strict, naming the key."""
    for result in rank_pool.run(_strict_error, 2):
        assert result == (
            "StateDictError: FullyShardedDataParallel.load_state_dict: the state dict has no "
            "value for 'head.bias' (1 of the model's 16 keys are missing); load a state dict "
            "of this model, or pass strict=False to load the keys it has"
        )


def _without_plugin() -> str:
    model = FSDP(ToyNet(), auto_wrap_policy=PER_BLOCK)
    saved = os.environ.get("SHARD_DISABLE_PLUGINS")
    os.environ["SHARD_DISABLE_PLUGINS"] = "checkpoint"
    reset_plugin_manager()
    try:
        with FSDP.state_dict_type(model, FULL):
            model.state_dict()
    except UnknownPluginNameError as exc:
        return str(exc)
    finally:
        if saved is None:
            del os.environ["SHARD_DISABLE_PLUGINS"]
        else:
            os.environ["SHARD_DISABLE_PLUGINS"] = saved
        reset_plugin_manager()
    return "no error"


def test_full_state_dict_without_shard_checkpoint_says_to_install_it(
    rank_pool: RankPool,
) -> None:
    """With shard-checkpoint's plugin blocked, FULL state_dict() names the distribution."""
    for result in rank_pool.run(_without_plugin, 2):
        hint = "Install shard-checkpoint from the shard repository (pip install ./packages/"
        assert hint in result
        assert result.startswith(
            "no shard plugin provides the state dicts of FullyShardedDataParallel"
        )


def test_registry_without_a_backend_says_to_install_shard_checkpoint() -> None:
    """A registry whose plugins provide no backend raises, naming shard-checkpoint."""
    registry = Registry(make_plugin_manager(load_entry_points=False))
    hint = r"Install shard-checkpoint from the shard repository \(pip install \./packages/"
    with pytest.raises(UnknownPluginNameError, match=hint):
        registry.state_dict_backend()


def test_settings_check_the_config_kind() -> None:
    """A config of another type's kind is PyTorch's RuntimeError, with the words its test matches,
    naming both and the fix; defaults fill the rest."""
    settings = StateDictSettings.of(FULL)
    assert settings.state_dict_config == FullStateDictConfig()
    with pytest.raises(
        RuntimeError,
        match=(
            r"^Expected state_dict_config of type FullStateDictConfig but got "
            r"LocalStateDictConfig: FULL_STATE_DICT takes a FullStateDictConfig; pass "
            r"FullStateDictConfig\(\.\.\.\) or None for its defaults$"
        ),
    ):
        StateDictSettings.of(FULL, LocalStateDictConfig())
    with pytest.raises(TypeError, match=r"state_dict_type must be a StateDictType, got 'full'"):
        StateDictSettings.of("full")  # type: ignore[arg-type]
