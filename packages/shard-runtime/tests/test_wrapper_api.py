"""FullyShardedDataParallel's surface: errors, flat shards, names, forwarding, summoning.

Each rank function builds its models on the shared rank pool and returns
plain values (shapes, names, messages, tensors); the tests compare them with
exact expectations and with an unsharded ``ToyNet`` built in this process.
Several tests read one run's results through a module-scoped fixture, so the
pool is visited once per topic.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shard_runtime import (
    FullyShardedDataParallel,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
    StateDictType,
    fully_shard,
)
from shard_runtime.plumbing import clean_fqn
from shard_testing import RankPool
from shard_testing.compat import error as _error
from shard_testing.models import ResidualBlock, ToyNet, toy_batches

FSDP = FullyShardedDataParallel
PER_BLOCK = ModuleWrapPolicy({ResidualBlock})
PARAM_NAMES = [name for name, _ in ToyNet().named_parameters()]


def _owner_and_leaf(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding ``name`` (an unwrapped name), reached by attribute forwarding."""
    owner: Any = model
    *path, leaf = name.split(".")
    for part in path:
        owner = owner[int(part)] if part.isdigit() else getattr(owner, part)
    return owner, leaf


def _visible(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every original parameter as the modules show it now, by its unwrapped name."""
    out = {}
    for name in PARAM_NAMES:
        owner, leaf = _owner_and_leaf(model, name)
        out[name] = getattr(owner, leaf).detach().clone()
    return out


def _toynet(**kwargs: Any) -> FullyShardedDataParallel:
    return FSDP(ToyNet(), auto_wrap_policy=PER_BLOCK, **kwargs)


# ---------------------------------------------------------------------- errors


class _TwoLinear(nn.Sequential):
    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(nn.Linear(2, 3), nn.Linear(3, 2))


def _frozen_mix(use_orig_params: bool) -> FullyShardedDataParallel:
    model = _TwoLinear()
    model[0].requires_grad_(False)
    return FSDP(model, use_orig_params=use_orig_params)


def _errors() -> dict[str, Any]:
    model = _TwoLinear()
    wrapped = FSDP(nn.Linear(2, 2))
    inner = nn.Linear(2, 2)
    FSDP(inner)
    composable = nn.Linear(2, 2)
    fully_shard(composable)
    holder = _TwoLinear()
    fully_shard(holder[1])
    outer = nn.Sequential(FSDP(nn.Linear(2, 2)), nn.Linear(2, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mixed_orig = _error(lambda: _frozen_mix(True))
    return {
        "hybrid": _error(
            lambda: FSDP(_TwoLinear(), sharding_strategy=ShardingStrategy.HYBRID_SHARD)
        ),
        "hybrid_zero2": _error(
            lambda: FSDP(_TwoLinear(), sharding_strategy=ShardingStrategy._HYBRID_SHARD_ZERO2)
        ),
        "param_init_fn": _error(lambda: FSDP(_TwoLinear(), param_init_fn=3)),  # type: ignore[arg-type]
        "frozen_flat": _error(lambda: _frozen_mix(False)),
        "frozen_orig": mixed_orig,
        "frozen_orig_warnings": [
            (w.category.__name__, str(w.message), os.path.basename(w.filename)) for w in caught
        ],
        "ignored_both": _error(
            lambda: FSDP(model, ignored_modules=[model[0]], ignored_states=[model[1]])
        ),
        "ignored_param_as_module": _error(
            lambda: FSDP(model, ignored_modules=[model[0].weight])  # type: ignore[list-item]
        ),
        "ignored_mixed": _error(lambda: FSDP(model, ignored_states=[model[0].weight, model[1]])),
        "ignored_wrapped": _error(lambda: FSDP(outer, ignored_modules=[outer[0]])),
        "rewrap_wrapper": _error(lambda: FSDP(wrapped)),
        "rewrap_inner": _error(lambda: FSDP(inner)),
        "wrap_fully_shard": _error(lambda: FSDP(composable)),
        "wrap_holding_fully_shard": _error(lambda: FSDP(holder)),
        "strategy_type": _error(lambda: FSDP(_TwoLinear(), sharding_strategy="FULL_SHARD")),  # type: ignore[arg-type]
    }


@pytest.fixture(scope="module")
def errors(rank_pool: RankPool) -> dict[str, Any]:
    rank0, rank1 = rank_pool.run(_errors, 2)
    assert rank0 == rank1
    result: dict[str, Any] = rank0
    return result


def test_hybrid_without_groups_mesh_or_policy_is_a_value_error(errors: dict[str, Any]) -> None:
    """Manual hybrid wrapping with no groups, mesh or auto_wrap_policy says what to pass."""
    for key, name in [("hybrid", "HYBRID_SHARD"), ("hybrid_zero2", "_HYBRID_SHARD_ZERO2")]:
        assert errors[key] == (
            f"ValueError: FullyShardedDataParallel: manual wrapping with {name} needs an "
            "explicit process_group=(shard_group, replicate_group) or a 2-D device_mesh; with "
            "an auto_wrap_policy the groups are built per node from LOCAL_WORLD_SIZE"
        )


def test_param_init_fn_not_callable_is_a_value_error(errors: dict[str, Any]) -> None:
    """A param_init_fn that cannot be called is rejected with the type seen."""
    assert errors["param_init_fn"] == (
        "ValueError: FullyShardedDataParallel: param_init_fn must be a callable taking a module "
        "(it is called on each module left on the meta device), got int"
    )


def test_frozen_and_trainable_in_one_flat_parameter_lists_both_groups(
    errors: dict[str, Any],
) -> None:
    """use_orig_params=False cannot mix frozen and trainable parameters; both groups are named,
    with the words PyTorch's tests match ("has both parameters with requires_grad=True and
    False")."""
    assert errors["frozen_flat"] == (
        "ValueError: FullyShardedDataParallel(_TwoLinear): one flat parameter cannot mix frozen "
        "and trainable parameters with use_orig_params=False (_TwoLinear has both parameters "
        "with requires_grad=True and False); frozen: 0.weight, 0.bias; "
        "trainable: 1.weight, 1.bias. Wrap them in separate units (an auto_wrap_policy), or "
        "pass use_orig_params=True"
    )


def test_frozen_and_trainable_with_orig_params_accepted_without_warning_by_hand(
    errors: dict[str, Any],
) -> None:
    """use_orig_params=True accepts the mix; a wrapper built by hand does not warn, as in
    PyTorch (units an auto-wrap policy makes do: test_fully_shard_frozen_params)."""
    assert errors["frozen_orig"] == "no error"
    assert errors["frozen_orig_warnings"] == []


def test_ignored_states_validation_surfaces_through_the_constructor(
    errors: dict[str, Any],
) -> None:
    """Both arguments, a parameter as a module, mixed kinds and a wrapper listed all fail."""
    prefix = "ValueError: FullyShardedDataParallel: "
    assert errors["ignored_both"] == (
        prefix + "Cannot pass both ignored_modules and ignored_states at the same time; pass "
        "everything as ignored_states (it takes modules, or parameters)"
    )
    assert errors["ignored_param_as_module"] == (
        prefix + "ignored_modules expects nn.Module entries, but ignored_modules[0] is the "
        "parameter '0.weight'; pass parameters as ignored_states=[...] instead"
    )
    assert errors["ignored_mixed"] == (
        prefix + "ignored_states expects all nn.Parameter or all nn.Module entries, but "
        "ignored_states[1] is the module Linear ('1') and ignored_states[0] the parameter "
        "'0.weight'; pass only modules, or only parameters (a module's are module.parameters())"
    )
    assert errors["ignored_wrapped"] == (
        prefix + "ignored_modules should not include FSDP modules: ignored_modules[0] is "
        "FullyShardedDataParallel ('0'), which is already sharded; list the modules it wraps "
        "that should stay whole when wrapping it, or leave it out"
    )


def test_wrapping_an_already_sharded_module_fails(errors: dict[str, Any]) -> None:
    """A wrapper, a wrapper's inner module, or a fully_shard module cannot be wrapped again."""
    prefix = "ValueError: FullyShardedDataParallel: "
    assert errors["rewrap_wrapper"] == (
        prefix + "the module is already a FullyShardedDataParallel (around Linear); wrap each "
        "module once"
    )
    assert errors["rewrap_inner"] == (
        prefix + "this Linear is already wrapped by a FullyShardedDataParallel (it is that "
        "wrapper's .module); wrap each module once and use the wrapper"
    )
    assert errors["wrap_fully_shard"] == (
        prefix + "this FSDPLinear is already sharded by fully_shard; shard a model with one "
        "front end, fully_shard or FullyShardedDataParallel"
    )
    assert errors["wrap_holding_fully_shard"] == (
        prefix + "submodule '1' (FSDPLinear) is already sharded by fully_shard; shard a model "
        "with one front end, fully_shard or FullyShardedDataParallel"
    )


def test_sharding_strategy_of_the_wrong_type_is_a_type_error(errors: dict[str, Any]) -> None:
    """A string where a ShardingStrategy belongs is named in the error."""
    assert errors["strategy_type"] == (
        "TypeError: FullyShardedDataParallel: sharding_strategy must be a ShardingStrategy, "
        "got 'FULL_SHARD'"
    )


# ---------------------------------------------------------------------- flat shards and names


def _shards() -> dict[str, Any]:
    torch.manual_seed(0)
    flat = FSDP(nn.Linear(10, 11))  # 110 + 11 = 121 elements
    torch.manual_seed(0)
    orig = FSDP(nn.Linear(10, 11), use_orig_params=True)
    return {
        "flat": [(n, p.detach().clone()) for n, p in flat.named_parameters()],
        "orig": [(n, p.detach().clone()) for n, p in orig.named_parameters()],
    }


def test_121_element_unit_holds_61_per_rank(rank_pool: RankPool) -> None:
    """The flat shard is ceil(121 / 2) = 61 elements, rank 1's last element zero padding."""
    torch.manual_seed(0)
    ref = nn.Linear(10, 11)
    full = torch.cat([ref.weight.detach().reshape(-1), ref.bias.detach()])
    rank0, rank1 = rank_pool.run(_shards, 2)
    # PyTorch's name: the flat parameter hangs under the wrapped module.
    expected = [("_fsdp_wrapped_module._flat_param", (61,))]
    assert [(n, tuple(p.shape)) for n, p in rank0["flat"]] == expected
    assert [(n, tuple(p.shape)) for n, p in rank1["flat"]] == expected
    torch.testing.assert_close(rank0["flat"][0][1], full[:61], rtol=0, atol=0)
    torch.testing.assert_close(rank1["flat"][0][1][:60], full[61:], rtol=0, atol=0)
    assert rank1["flat"][0][1][60].item() == 0.0


def test_orig_params_are_1d_pieces_of_the_aligned_flat_shard(rank_pool: RankPool) -> None:
    """use_orig_params=True: each parameter is its piece of the 16-byte-aligned flat buffer.

    The weight's 110 elements are padded to 112 before the bias, 123 elements
    make 62 per rank: rank 0 holds weight[0:62], rank 1 weight[62:110] and the bias.
    """
    torch.manual_seed(0)
    ref = nn.Linear(10, 11)
    weight = ref.weight.detach().reshape(-1)
    rank0, rank1 = rank_pool.run(_shards, 2)
    names = ["_fsdp_wrapped_module.weight", "_fsdp_wrapped_module.bias"]
    assert [(n, tuple(p.shape)) for n, p in rank0["orig"]] == list(
        zip(names, [(62,), (0,)], strict=True)
    )
    assert [(n, tuple(p.shape)) for n, p in rank1["orig"]] == list(
        zip(names, [(48,), (11,)], strict=True)
    )
    torch.testing.assert_close(rank0["orig"][0][1], weight[:62], rtol=0, atol=0)
    torch.testing.assert_close(rank1["orig"][0][1], weight[62:], rtol=0, atol=0)
    torch.testing.assert_close(rank1["orig"][1][1], ref.bias.detach(), rtol=0, atol=0)


def _names(use_orig_params: bool) -> dict[str, Any]:
    model = _toynet(use_orig_params=use_orig_params)
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        state = model.state_dict()
        reloaded = _error(lambda: model.load_state_dict(state))
    return {
        "named_parameters": [(n, tuple(p.shape)) for n, p in model.named_parameters()],
        "values": {clean_fqn(n): p.detach().clone() for n, p in model.named_parameters()},
        "parameters": [tuple(p.shape) for p in model.parameters()],
        "state_dict": {
            k: (type(v).__name__, tuple(v.shape), tuple(v.to_local().shape))
            for k, v in state.items()
        },
        "load_state_dict": reloaded,
    }


FLAT_NAMES = ["_flat_param", "blocks.0._flat_param", "blocks.1._flat_param", "blocks.2._flat_param"]
# What PyTorch's wrapper calls them in named_parameters(): each under its wrapped module.
TORCH_FLAT_NAMES = [
    "_fsdp_wrapped_module._flat_param",
    *(f"_fsdp_wrapped_module.blocks.{i}._fsdp_wrapped_module._flat_param" for i in range(3)),
]


def test_flat_parameters_are_named_as_in_pytorch(rank_pool: RankPool) -> None:
    """use_orig_params=False: parameters() are the flat shards under PyTorch's names; LOCAL
    state dicts name them without wrapper segments, as DTensors of the unpadded flat buffer
    (PyTorch's sizes: the last rank's piece leaves the padding out)."""
    # root: embed 60 + 10, head 30 + 3 = 103 -> 52; a block: 210 + 21 + 210 + 10 = 451 -> 226
    totals = [103, 451, 451, 451]
    sizes = [(52,), (226,), (226,), (226,)]
    for rank, result in enumerate(rank_pool.run(_names, 2, False)):
        assert result["named_parameters"] == list(zip(TORCH_FLAT_NAMES, sizes, strict=True))
        assert result["parameters"] == sizes
        assert result["state_dict"] == {
            name: ("DTensor", (total,), (n if rank == 0 else total - n,))
            for name, total, (n,) in zip(FLAT_NAMES, totals, sizes, strict=True)
        }
        assert result["load_state_dict"] == "no error"


def test_orig_parameters_keep_their_names_as_1d_local_pieces(rank_pool: RankPool) -> None:
    """use_orig_params=True: the original names (with PyTorch's wrapper segments); the two
    ranks' pieces make each parameter."""
    ref = dict(ToyNet().named_parameters())
    rank0, rank1 = rank_pool.run(_names, 2, True)
    for result in (rank0, rank1):
        names = [n for n, _ in result["named_parameters"]]
        assert [clean_fqn(n) for n in names] == PARAM_NAMES
        assert names[0] == "_fsdp_wrapped_module.embed.weight"
        assert names[2] == "_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.inner.weight"
        assert all(len(shape) == 1 for _, shape in result["named_parameters"])
        assert list(result["state_dict"]) == FLAT_NAMES  # LOCAL: the flat shards, either way
        assert result["load_state_dict"] == "no error"
    for name, param in ref.items():
        joined = torch.cat([rank0["values"][name], rank1["values"][name]])  # by clean name
        torch.testing.assert_close(joined, param.detach().reshape(-1), rtol=0, atol=0)


def _surface() -> dict[str, Any]:
    model = _toynet()
    seq = FSDP(_TwoLinear())
    seq.apply(lambda m: nn.init.zeros_(m.weight) if isinstance(m, nn.Linear) else None)
    with FSDP.summon_full_params(seq):
        applied = {
            "0.weight": seq[0].weight.detach().clone(),
            "0.bias": seq[0].bias.detach().clone(),
            "1.weight": seq[1].weight.detach().clone(),
        }
    inner = model.blocks[1]
    return {
        "blocks": type(model.blocks).__name__,
        "block": type(model.blocks[0]).__name__,
        "block_module": type(model.blocks[0].module).__name__,
        "head": type(model.head).__name__,
        "module": type(model.module).__name__,
        "seq_item": type(seq[1]).__name__,
        "fsdp_modules": [type(m.module).__name__ for m in FSDP.fsdp_modules(model)],
        "root_only": [m is model for m in FSDP.fsdp_modules(model, root_only=True)],
        "inner_fsdp_modules": [m is inner for m in FSDP.fsdp_modules(inner)],
        "applied": applied,
        "repr": repr(seq),
        "placeholder": (
            tuple(model.head.weight.shape),
            model.head.weight.dtype,
            model.head.weight.device.type,
        ),
        "no_sync_inner": _error(lambda: inner.no_sync().__enter__()),
    }


@pytest.fixture(scope="module")
def surface(rank_pool: RankPool) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = rank_pool.run(_surface, 2)
    return results


def test_attributes_forward_to_the_wrapped_module(surface: list[dict[str, Any]]) -> None:
    """model.blocks, model.head, model[0], .module and fsdp_modules reach what users expect."""
    for result in surface:
        assert result["blocks"] == "ModuleList"
        assert result["block"] == "FullyShardedDataParallel"
        assert result["block_module"] == "ResidualBlock"
        assert result["head"] == "Linear"
        assert result["module"] == "ToyNet"
        assert result["seq_item"] == "Linear"
        assert result["fsdp_modules"] == [
            "ToyNet",
            "ResidualBlock",
            "ResidualBlock",
            "ResidualBlock",
        ]
        assert result["root_only"] == [True]
        assert result["inner_fsdp_modules"] == [True]
        assert result["no_sync_inner"] == (
            "RuntimeError: FullyShardedDataParallel.no_sync() must be called on the root "
            "wrapper, not on the inner one around ResidualBlock"
        )


def test_apply_runs_on_full_parameters_and_writes_back(surface: list[dict[str, Any]]) -> None:
    """apply(zeros_ on every Linear weight) zeroes the full weights; the biases are untouched."""
    ref = _TwoLinear()
    for result in surface:
        applied = result["applied"]
        torch.testing.assert_close(applied["0.weight"], torch.zeros(3, 2), rtol=0, atol=0)
        torch.testing.assert_close(applied["1.weight"], torch.zeros(2, 3), rtol=0, atol=0)
        torch.testing.assert_close(applied["0.bias"], ref[0].bias.detach(), rtol=0, atol=0)


def test_print_works_and_flat_modules_hold_shape_placeholders(
    surface: list[dict[str, Any]],
) -> None:
    """Between steps a flat unit's modules hold meta placeholders: repr and shapes work."""
    for result in surface:
        assert "(0): Linear(in_features=2, out_features=3, bias=True)" in result["repr"]
        assert result["placeholder"] == ((3, 10), torch.float32, "meta")


def _parameterless_root() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = FSDP(_TwoLinear(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    x = torch.randn(world, 2, generator=torch.Generator().manual_seed(3))[rank : rank + 1]
    model(x).sum().backward()
    with FSDP.summon_full_params(model, writeback=False):
        full = [tuple(model[0].weight.shape), tuple(model[1].weight.shape)]
    return {
        "named_parameters": [(n, tuple(p.shape)) for n, p in model.named_parameters()],
        "grads": [p.grad is not None for p in model.parameters()],
        "full": full,
    }


def test_root_without_parameters_of_its_own_trains(rank_pool: RankPool) -> None:
    """A root whose children are all units (an empty flat unit) runs forward, backward, summon."""
    for result in rank_pool.run(_parameterless_root, 2):
        # 0: 6 + 3 = 9 -> 5 per rank; 1: 6 + 2 = 8 -> 4 per rank
        assert result["named_parameters"] == [
            ("_fsdp_wrapped_module.0._fsdp_wrapped_module._flat_param", (5,)),
            ("_fsdp_wrapped_module.1._fsdp_wrapped_module._flat_param", (4,)),
        ]
        assert result["grads"] == [True, True]
        assert result["full"] == [(3, 2), (2, 3)]


# ---------------------------------------------------------------------- summon_full_params


def _edit_and_forward(model: nn.Module, writeback: bool, x: torch.Tensor) -> torch.Tensor:
    with FSDP.summon_full_params(model, writeback=writeback), torch.no_grad():
        model.blocks[0].inner.weight.mul_(0.5)
    with torch.no_grad():
        return model(x)


def _seen(t: torch.Tensor) -> tuple[tuple[int, ...], str]:
    return tuple(t.shape), t.device.type


def _summon(use_orig_params: bool) -> dict[str, Any]:
    model = _toynet(use_orig_params=use_orig_params)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(7))
    with FSDP.summon_full_params(model):
        full = _visible(model)
    kept = _edit_and_forward(model, True, x)
    discarded = _edit_and_forward(model, False, x)
    with FSDP.summon_full_params(model, rank0_only=True, writeback=False):
        rank0_only = _seen(model.blocks[0].inner.weight)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with FSDP.summon_full_params(model, offload_to_cpu=True, writeback=False):
            offloaded = _visible(model)
    with FSDP.summon_full_params(model, recurse=False, writeback=False):
        outer_only = (_seen(model.embed.weight), _seen(model.blocks[0].inner.weight))
    return {
        "full": full,
        "kept": kept,
        "discarded": discarded,
        "rank0_only": rank0_only,
        "offloaded": offloaded,
        "offload_warning": [(w.category.__name__, w.filename) for w in caught],
        "outer_only": outer_only,
        "rank0_writeback": _error(
            lambda: FSDP.summon_full_params(model, rank0_only=True).__enter__()
        ),
    }


@pytest.fixture(scope="module", params=[False, True], ids=["flat", "orig"])
def summoned(request: pytest.FixtureRequest, rank_pool: RankPool) -> tuple[bool, list[Any]]:
    return request.param, rank_pool.run(_summon, 2, request.param)


def test_summon_shows_single_process_parameters(summoned: tuple[bool, list[Any]]) -> None:
    """Inside the block every parameter has its full shape and the unsharded model's values.

    ``offloaded`` was summoned after the kept edit (the first block's inner weight halved).
    """
    ref = dict(ToyNet().named_parameters())
    for result in summoned[1]:
        assert list(result["full"]) == PARAM_NAMES
        for name, value in result["full"].items():
            torch.testing.assert_close(value, ref[name].detach(), rtol=0, atol=0)
        # As PyTorch: a full CPU copy on every rank is worth a warning, blamed on the caller.
        assert result["offload_warning"] == [("UserWarning", __file__)]
        for name, value in result["offloaded"].items():
            assert value.device.type == "cpu"
            factor = 0.5 if name == "blocks.0.inner.weight" else 1.0
            torch.testing.assert_close(value, ref[name].detach() * factor, rtol=0, atol=0)


def test_summon_writeback_persists_and_no_writeback_discards(
    summoned: tuple[bool, list[Any]],
) -> None:
    """An edit inside writeback=True reaches the next forward; under writeback=False it does not."""
    ref = ToyNet()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref.blocks[0].inner.weight.mul_(0.5)
        expected = ref(x)
    for result in summoned[1]:
        torch.testing.assert_close(result["kept"], expected)
        torch.testing.assert_close(result["discarded"], expected)  # the second edit was dropped


# What a block's weight looks like when its unit is not summoned, on rank 0 and rank 1:
# a meta placeholder of the full shape (flat), or the rank's 1-D piece (original parameters).
NOT_SUMMONED = {
    False: [((21, 10), "meta"), ((21, 10), "meta")],
    True: [((210,), "cpu"), ((0,), "cpu")],
}


def test_summon_recurse_false_gathers_only_the_outer_unit(
    summoned: tuple[bool, list[Any]],
) -> None:
    """recurse=False: the root's own parameters are full, a block's stay sharded."""
    orig, results = summoned
    for result, block in zip(results, NOT_SUMMONED[orig], strict=True):
        assert result["outer_only"] == (((10, 6), "cpu"), block)


def test_summon_rank0_only_shows_full_parameters_on_rank_0_only(
    summoned: tuple[bool, list[Any]],
) -> None:
    """rank0_only=True: rank 0 sees the full weight, rank 1 not; with writeback it is an error."""
    orig, (rank0, rank1) = summoned
    assert rank0["rank0_only"] == ((21, 10), "cpu")
    assert rank1["rank0_only"] == NOT_SUMMONED[orig][1]
    for result in (rank0, rank1):
        assert result["rank0_writeback"] == (
            "NotImplementedError: summon_full_params: writeback=True and rank0_only=True is not "
            "supported: the other ranks see no full parameters to write back; pass "
            "writeback=False"
        )


def _with_grads() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _toynet(use_orig_params=True)
    x, y = toy_batches(world, 1)[0][0][rank]
    nn.functional.mse_loss(model(x), y).backward()
    local = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
    with FSDP.summon_full_params(model, with_grads=True, writeback=False):
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    after = [p.grad for p in model.parameters()]
    restored = all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(local, after, strict=True)
    )
    flat = _toynet()
    return {
        "grads": grads,
        "restored": restored,
        "flat": _error(lambda: FSDP.summon_full_params(flat, with_grads=True).__enter__()),
    }


def test_summon_with_grads_shows_the_averaged_single_process_gradient(
    rank_pool: RankPool,
) -> None:
    """with_grads=True (original parameters): full averaged gradients equal one process's."""
    ref = ToyNet()
    batch = toy_batches(2, 1)[0][0]
    x = torch.cat([x for x, _ in batch])
    y = torch.cat([y for _, y in batch])
    nn.functional.mse_loss(ref(x), y).backward()
    for result in rank_pool.run(_with_grads, 2):
        assert list(result["grads"]) == PARAM_NAMES
        for name, param in ref.named_parameters():
            assert param.grad is not None
            torch.testing.assert_close(result["grads"][name], param.grad)
        assert result["restored"] is True
        assert result["flat"] == (
            "NotImplementedError: summon_full_params: with_grads=True with use_orig_params=False "
            "is not supported: the unit 'ToyNet' was wrapped with use_orig_params=False; wrap "
            "with use_orig_params=True to see full gradients"
        )


def _with_grads_before_backward() -> dict[str, bool]:
    model = _toynet(use_orig_params=True)
    with FSDP.summon_full_params(model, with_grads=True, writeback=False):
        pass
    return {clean_fqn(n): p.grad is None for n, p in model.named_parameters()}


def test_summon_with_grads_leaves_missing_gradients_missing(rank_pool: RankPool) -> None:
    """Before any backward, with_grads=True leaves every .grad None afterwards (not zeros)."""
    for result in rank_pool.run(_with_grads_before_backward, 2):
        assert result == dict.fromkeys(PARAM_NAMES, True)


def _mixed_precision_summon() -> dict[str, torch.Tensor]:
    model = _toynet(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    x = torch.randn(4, 6)
    model(x).sum().backward()
    with FSDP.summon_full_params(model, writeback=False):
        return _visible(model)


def test_summon_under_mixed_precision_shows_full_precision(rank_pool: RankPool) -> None:
    """With bf16 compute, summon shows the fp32 parameters, not bf16 copies."""
    ref = dict(ToyNet().named_parameters())
    for result in rank_pool.run(_mixed_precision_summon, 2):
        for name, value in result.items():
            assert value.dtype == torch.float32
            torch.testing.assert_close(value, ref[name].detach(), rtol=0, atol=0)


# ---------------------------------------------------------------------- debug mode


class _RankOrdered(nn.Module):
    """Runs its two layers in an order that depends on the rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 0:
            return self.b(self.a(x))
        return self.a(self.b(x))


def _rank_dependent_order() -> str:
    os.environ["SHARD_DEBUG"] = "detail"
    model = FSDP(_RankOrdered(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    return _error(lambda: model(torch.randn(2, 4)).sum().backward())


def test_debug_mode_reports_a_rank_dependent_forward_order(rank_pool: RankPool) -> None:
    """SHARD_DEBUG=detail: every rank raises 'Forward order differs across ranks', naming units."""
    results = rank_pool.run(_rank_dependent_order, 2)
    assert results[0] == results[1]
    assert results[0] == (
        "RuntimeError: Forward order differs across ranks at unit position 1 of the first "
        "iteration (after 1 unit(s) in the same order): rank 0 runs 'a', rank 1 runs 'b'. "
        "Every rank must run the same units in the same order, or their all-gathers pair up "
        "wrongly and training hangs or mixes parameters; look for a data-dependent branch "
        "that skips or reorders a module on some ranks."
    )
