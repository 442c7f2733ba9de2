"""Drop-in fidelity with ``torch.distributed.checkpoint.state_dict``, side by side on 2 ranks.

One script runs the same user code with PyTorch's front end and functional
API (``impl="torch"``) and with shard's (``impl="shard"``); the tests assert
that both give the same keys, values and outcomes. Exceptions are compared
by the built-in class a PyTorch user catches: shard's ``StateDictError`` is a
``RuntimeError`` (PyTorch raises exactly ``RuntimeError``) and also a
``ValueError``, so :func:`_caught` looks for ``RuntimeError`` first.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable
from typing import Any, get_args

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as torch_api
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import shard_checkpoint
from shard_testing import RankPool
from shard_testing.models import ResidualBlock, ToyNet, toy_batches

FRONTS = ("fully_shard", "wrapper", "plain")

# [Note: the wrapper's reference]
# PyTorch's FullyShardedDataParallel refuses CPU-only machines ("FSDP needs a
# non-CPU accelerator device"), so on the "wrapper" front the PyTorch side
# runs its fully_shard: the functional API's answers (keys, full values,
# outcomes) do not depend on the front end, so shard's wrapper must give
# exactly what PyTorch gives for the same model. Sharded values differ by
# front end (PyTorch's wrapper gives ShardedTensors), so they are compared on
# the "fully_shard" front only. So does the order of the optimizer state:
# PyTorch's wrapper with use_orig_params=True lists it by parameter name
# (shard's wrapper too, pinned beside PyTorch's FSDP1 in shard-runtime's
# test_compat_wrapper_state_dict.py), fully_shard in parameter order; on the
# "wrapper" front the listed optimizer keys are compared as sets.
_OPTIM_KEY_LISTS = ("flat_optim_keys", "submodules_optim", "submodules_both")


def _caught(exc: BaseException) -> str:
    """The built-in class a PyTorch user would catch ``exc`` as."""
    for cls in (RuntimeError, ValueError, KeyError, TypeError, AttributeError):
        if isinstance(exc, cls):
            return cls.__name__
    return type(exc).__name__


def _outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        value = fn()
    except Exception as exc:
        return ("raises", _caught(exc))
    return ("returns", value)


def _exact_error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__
    return "no error"


def _plain(value: Any) -> Any:
    """Tensors (and DTensors, as their local shard) as nested lists; containers recursively."""
    if isinstance(value, DTensor):
        return ["local", value.to_local().tolist()]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _keys(result: Any) -> tuple[list[str], list[str]]:
    """``(missing, unexpected)`` of an ``_IncompatibleKeys``-like result."""
    return list(result.missing_keys), list(result.unexpected_keys)


def _api(impl: str) -> Any:
    return torch_api if impl == "torch" else shard_checkpoint


def _build(impl: str, front: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """ToyNet with ``embed.weight`` frozen, sharded by ``front`` of ``impl``, and its Adam."""
    # Imported here: only tests may import PyTorch FSDP, and each side imports its own.
    model: nn.Module = ToyNet(blocks=2, seed=seed)
    model.embed.weight.requires_grad_(False)
    if impl == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    else:
        from shard_runtime import FullyShardedDataParallel, ModuleWrapPolicy, fully_shard
    if front == "fully_shard" or (front == "wrapper" and impl == "torch"):
        # See [Note: the wrapper's reference]
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif front == "wrapper":
        model = FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({ResidualBlock}), use_orig_params=True
        )
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.Adam(params, lr=0.01)


def _train_step(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    x, y = toy_batches(dist.get_world_size(), steps=1)[0][0][dist.get_rank()]
    nn.functional.mse_loss(model(x), y).backward()
    optim.step()
    optim.zero_grad()


def _script(impl: str, front: str) -> dict[str, Any]:
    """The user code, on every rank: returns what it saw as plain values."""
    api = _api(impl)
    options = api.StateDictOptions
    full = options(full_state_dict=True)
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, optim = _build(impl, front, seed=0)
        _train_step(model, optim)
        fresh, fresh_optim = _build(impl, front, seed=1)
        # - keys and full values
        msd, osd = api.get_state_dict(model, optim, options=full)
        out["keys"] = list(msd)
        out["full"] = _plain((msd, osd))
        offloaded = api.get_state_dict(
            model, optim, options=options(full_state_dict=True, cpu_offload=True)
        )
        out["cpu_offload"] = _plain(offloaded)
        out["flat_optim_keys"] = list(
            api.get_optimizer_state_dict(
                model, [optim], options=options(flatten_optimizer_state_dict=True)
            )
        )
        if front == "fully_shard":
            sharded = api.get_model_state_dict(model)
            out["sharded"] = _plain(sharded)
            # - round trip of sharded state dicts through set_state_dict
            sharded_osd = api.get_optimizer_state_dict(model, optim)
            out["set_sharded"] = _outcome(
                lambda: _keys(
                    api.set_state_dict(
                        fresh,
                        fresh_optim,
                        model_state_dict=sharded,
                        optim_state_dict=sharded_osd,
                    )
                )
            )
            out["after_set_sharded"] = _plain(api.get_state_dict(fresh, fresh_optim, options=full))
        # - round trip of full state dicts (keyword model_state_dict=, then both)
        out["set_keyword"] = _outcome(
            lambda: _keys(api.set_model_state_dict(fresh, model_state_dict=msd, options=full))
        )
        out["set_full"] = _outcome(
            lambda: _keys(
                api.set_state_dict(
                    fresh, [fresh_optim], model_state_dict=msd, optim_state_dict=osd, options=full
                )
            )
        )
        out["after_set_full"] = _plain(api.get_state_dict(fresh, fresh_optim, options=full))
        out["optim_only"] = _outcome(
            lambda: _keys(
                api.set_state_dict(
                    fresh, fresh_optim, model_state_dict={}, optim_state_dict=osd, options=full
                )
            )
        )
        out["model_only"] = _plain(api.get_state_dict(model, [], options=full))
        # - ignore_frozen_params: the getter leaves embed.weight out; strict loading misses it
        frozen = api.get_model_state_dict(model, options=options(ignore_frozen_params=True))
        out["frozen_keys"] = list(frozen)
        out["frozen_set_strict"] = _outcome(lambda: api.set_model_state_dict(fresh, frozen))
        relaxed = options(strict=False)
        out["frozen_set_relaxed"] = _outcome(
            lambda: _keys(api.set_model_state_dict(fresh, frozen, options=relaxed))
        )
        # - submodules (deprecated) and keep_submodule_prefixes
        block = model.blocks[1]
        out["submodules_kept"] = list(api.get_model_state_dict(model, submodules={block}))
        out["submodules_stripped"] = list(
            api.get_model_state_dict(
                model, submodules={block}, options=options(keep_submodule_prefixes=False)
            )
        )
        out["submodules_empty_set"] = list(api.get_model_state_dict(model, submodules=set()))
        out["submodules_optim"] = list(
            api.get_optimizer_state_dict(model, optim, submodules={block})["state"]
        )
        out["submodules_both"] = [
            list(part.get("state", part))
            for part in api.get_state_dict(model, optim, submodules={block})
        ]
        # - StateDictOptions is mutable: flipping strict on a shared object takes effect
        shared = options()
        shared.strict = False
        out["mutable"] = _outcome(
            lambda: _keys(
                api.set_model_state_dict(fresh, {**msd, "bogus": torch.ones(1)}, options=shared)
            )
        )
        shared.strict = True
        # - bad input
        out["unexpected_strict"] = _outcome(
            lambda: api.set_model_state_dict(fresh, {**msd, "bogus": torch.ones(1)}, options=shared)
        )
        sharded_partial = api.get_model_state_dict(model)
        del sharded_partial["head.bias"]
        out["missing_strict"] = _outcome(lambda: api.set_model_state_dict(fresh, sharded_partial))
        out["missing_relaxed"] = _outcome(
            lambda: _keys(api.set_model_state_dict(fresh, sharded_partial, options=relaxed))
        )
        out["empty_strict"] = _outcome(lambda: api.set_model_state_dict(fresh, {}))
        out["empty_relaxed"] = _outcome(
            lambda: _keys(api.set_model_state_dict(fresh, {}, options=relaxed))
        )
        out["empty_optim"] = _outcome(lambda: api.set_optimizer_state_dict(fresh, fresh_optim, {}))
        out["no_optimizer"] = _outcome(lambda: api.get_optimizer_state_dict(model, []))
        out["nothing_to_set"] = _outcome(
            lambda: api.set_state_dict(fresh, [], model_state_dict={}, optim_state_dict={})
        )
        out["broadcast_without_full"] = _exact_error(
            lambda: api.get_model_state_dict(model, options=options(broadcast_from_rank0=True))
        )
        out["unexpected_strict_exact"] = _exact_error(
            lambda: api.set_model_state_dict(fresh, {**msd, "bogus": torch.ones(1)})
        )
    out["warnings"] = sorted(w.category.__name__ for w in caught if "submodule" in str(w.message))
    return out


# ---------------------------------------------------------------------- the surface

FUNCTIONS = [
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]
ALIASES = [
    "FQNS_T",
    "PrimitiveType",
    "ValueType",
    "DictValueType",
    "ListDictValueType",
    "OptimizerStateType",
]


def _parameters(fn: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    """Name, kind (keyword-only markers included) and default of each parameter.

    Annotations are left out: they name each library's own classes.
    """
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_every_name_pytorch_exports_is_exported() -> None:
    """shard_checkpoint.__all__ holds every name of the PyTorch module's __all__."""
    assert sorted(torch_api.__all__) == sorted([*FUNCTIONS, *ALIASES, "StateDictOptions"])
    assert set(torch_api.__all__) <= set(shard_checkpoint.__all__)


def test_every_function_has_pytorchs_signature() -> None:
    """Parameter names, kinds and defaults of every function and of StateDictOptions match."""
    functions = [n for n in torch_api.__all__ if inspect.isfunction(getattr(torch_api, n))]
    assert sorted(functions) == FUNCTIONS
    for name in [*functions, "StateDictOptions"]:
        ours, theirs = getattr(shard_checkpoint, name), getattr(torch_api, name)
        assert _parameters(ours) == _parameters(theirs), name


def test_type_aliases_mean_what_pytorchs_do() -> None:
    """Each alias spells PyTorch's, less the legacy ShardedTensor (a torch.Tensor subclass)."""
    assert issubclass(ShardedTensor, torch.Tensor)
    legacy = f"{ShardedTensor.__module__}.{ShardedTensor.__qualname__} | "
    for name in ALIASES:
        theirs = repr(getattr(torch_api, name))
        assert legacy in theirs or name == "FQNS_T", name
        assert repr(getattr(shard_checkpoint, name)) == theirs.replace(legacy, ""), name
    assert get_args(shard_checkpoint.PrimitiveType) == (DTensor, torch.Tensor, int, float, str)


# ---------------------------------------------------------------------- side by side


@pytest.fixture(scope="module")
def sides(rank_pool: RankPool) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Per (impl, front): the script's per-rank results (six runs on 2 ranks)."""
    return {
        (impl, front): rank_pool.run(_script, 2, impl, front)
        for front in FRONTS
        for impl in ("torch", "shard")
    }


def _as_sets(keys: list[Any]) -> list[Any]:
    """A list of keys, or of such lists, without its order."""
    if keys and isinstance(keys[0], list):
        return [sorted(part) for part in keys]
    return sorted(keys)


@pytest.mark.parametrize("front", FRONTS)
def test_side_by_side_results_are_identical(
    sides: dict[tuple[str, str], list[dict[str, Any]]], front: str
) -> None:
    """Every key, value and outcome of the script is the same with PyTorch and with shard."""
    theirs, ours = sides[("torch", front)], sides[("shard", front)]
    for rank in range(2):
        assert list(ours[rank]) == list(theirs[rank])
        for name in theirs[rank]:
            if name == "unexpected_strict_exact":
                continue
            if front == "wrapper" and name in _OPTIM_KEY_LISTS:
                # See [Note: the wrapper's reference].
                assert _as_sets(ours[rank][name]) == _as_sets(theirs[rank][name]), (rank, name)
            else:
                assert ours[rank][name] == theirs[rank][name], (front, rank, name)


@pytest.mark.parametrize("front", FRONTS)
def test_exception_classes_are_pytorchs_or_derive_from_them(
    sides: dict[tuple[str, str], list[dict[str, Any]]], front: str
) -> None:
    """Bad options raise exactly PyTorch's ValueError; key errors a RuntimeError subclass."""
    for theirs, ours in zip(sides[("torch", front)], sides[("shard", front)], strict=True):
        assert theirs["broadcast_without_full"] == ours["broadcast_without_full"] == "ValueError"
        assert theirs["unexpected_strict_exact"] == "RuntimeError"
        assert ours["unexpected_strict_exact"] == "StateDictError"
        assert issubclass(shard_checkpoint.StateDictError, RuntimeError)
        for name in ("unexpected_strict", "missing_strict", "empty_strict", "empty_optim"):
            assert theirs[name] == ours[name] == ("raises", "RuntimeError"), name


BLOCKS = [f"blocks.{i}.{part}" for i in (0, 1) for part in ("inner", "outer")]
KEYS = [f"{module}.{name}" for module in ["embed", *BLOCKS, "head"] for name in ("weight", "bias")]
TRAINED = [key for key in KEYS if key != "embed.weight"]
BLOCK_1 = [key for key in KEYS if key.startswith("blocks.1.")]


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("impl", ["torch", "shard"])
def test_options_and_arguments_do_what_pytorch_does(
    sides: dict[tuple[str, str], list[dict[str, Any]]], impl: str, front: str
) -> None:
    """The expected answers, asserted on both sides (so a change on both cannot pass unseen)."""
    rank0, rank1 = sides[(impl, front)]
    # shard's wrapper lists optimizer state by name: see [Note: the wrapper's reference].
    in_state = sorted(TRAINED) if (impl, front) == ("shard", "wrapper") else TRAINED
    for result in (rank0, rank1):
        assert result["keys"] == KEYS
        full_model, full_optim = result["full"]
        assert list(full_model) == KEYS
        assert list(full_optim["state"]) == in_state
        assert full_optim["param_groups"][0]["params"] == TRAINED
        assert {"state.head.weight.exp_avg", "param_groups.head.weight.lr"} <= set(
            result["flat_optim_keys"]
        )
        # round trips: everything loads, and the fresh model then equals the trained one
        for name in ("set_keyword", "set_full", "optim_only"):
            assert result[name] == ("returns", ([], [])), name
        assert result["after_set_full"] == result["full"]
        if front == "fully_shard":
            assert result["set_sharded"] == ("returns", ([], []))
            assert result["after_set_sharded"] == result["full"]
        assert result["model_only"] == [full_model, {}]
        # ignore_frozen_params
        assert result["frozen_keys"] == TRAINED
        assert result["frozen_set_strict"] == ("raises", "RuntimeError")
        assert result["frozen_set_relaxed"] == ("returns", (["embed.weight"], []))
        # submodules: model keys only, with or without the prefix; a FutureWarning each time
        assert result["submodules_kept"] == BLOCK_1
        assert result["submodules_stripped"] == [k.removeprefix("blocks.1.") for k in BLOCK_1]
        assert result["submodules_empty_set"] == KEYS
        assert result["submodules_optim"] == in_state
        assert result["submodules_both"] == [BLOCK_1, in_state]
        assert result["warnings"] == ["FutureWarning"] * 4
        # mutability, strictness, empty input
        assert result["mutable"] == ("returns", ([], ["bogus"]))
        assert result["missing_relaxed"] == ("returns", (["head.bias"], []))
        assert result["empty_relaxed"] == ("returns", ([], []))
        assert result["no_optimizer"] == ("raises", "RuntimeError")
        assert result["nothing_to_set"] == ("raises", "RuntimeError")
    # cpu_offload with full_state_dict: rank 0 alone keeps the values
    assert rank0["cpu_offload"] == rank0["full"]
    assert rank1["cpu_offload"] == [{}, {}]


# ---------------------------------------------------------------------- renaming hooks


class FusedLinear(nn.Module):
    """A module whose state-dict hooks save its child's tensors under its own prefix.

    ``embedding.weight`` is saved as ``weight`` (as PyTorch's test
    ``FusionEmbeddingWithModifier`` does) and declared by ``_fqn_modifiers``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))
        self._register_state_dict_hook(FusedLinear._save_hook)
        self._register_load_state_dict_pre_hook(FusedLinear._load_hook, with_module=True)

    @staticmethod
    def _save_hook(module: nn.Module, destination: Any, prefix: str, metadata: Any) -> None:
        for name in ("weight", "bias"):
            destination[prefix + name] = destination.pop(f"{prefix}embedding.{name}")

    def _load_hook(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for name in ("weight", "bias"):
            if prefix + name in state_dict:
                state_dict[f"{prefix}embedding.{name}"] = state_dict.pop(prefix + name)

    def _fqn_modifiers(self) -> dict[str, str]:
        return {"weight": "embedding", "bias": "embedding"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.embedding(x) * self.scale
        return out


def _hooked_model(impl: str, seed: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from shard_runtime import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 4), FusedLinear(), nn.Linear(4, 2))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    (torch_fully_shard if impl == "torch" else fully_shard)(model, mesh=mesh)
    return model


def _hooked(impl: str) -> dict[str, Any]:
    api = _api(impl)
    options = api.StateDictOptions
    full = options(full_state_dict=True)
    model, fresh = _hooked_model(impl, 0), _hooked_model(impl, 1)
    out: dict[str, Any] = {"keys": list(api.get_model_state_dict(model))}
    state = api.get_model_state_dict(model, options=full)
    out["full"] = _plain(state)
    out["set_full"] = _outcome(lambda: _keys(api.set_model_state_dict(fresh, state, options=full)))
    out["after_set_full"] = _plain(api.get_model_state_dict(fresh, options=full))
    # PyTorch reports no missing key when loading full values (it fills them from the
    # model), so the partial load goes through sharded values.
    sharded = api.get_model_state_dict(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["set_submodule_keyed"] = _outcome(
            lambda: _keys(
                api.set_model_state_dict(
                    fresh,
                    {fresh[1]: {"weight": sharded["1.weight"], "bias": sharded["1.bias"]}},
                    options=options(strict=False),
                )
            )
        )
    out["submodule_keyed_warnings"] = [w.category.__name__ for w in caught]
    model[1].embedding.weight.requires_grad_(False)
    out["frozen"] = _outcome(
        lambda: list(api.get_model_state_dict(model, options=options(ignore_frozen_params=True)))
    )
    out["frozen_other_modifiers"] = _outcome(
        lambda: list(
            api.get_model_state_dict(
                model, options=options(ignore_frozen_params=True, dsd_fqn_modifiers="_none")
            )
        )
    )
    return out


def test_keys_renamed_by_state_dict_hooks(rank_pool: RankPool) -> None:
    """Hook-renamed keys, their order and round trips match; frozen ones map through modifiers."""
    theirs = rank_pool.run(_hooked, 2, "torch")
    ours = rank_pool.run(_hooked, 2, "shard")
    keys = ["0.weight", "0.bias", "1.scale", "1.weight", "1.bias", "2.weight", "2.bias"]
    for their, our in zip(theirs, ours, strict=True):
        names = ["keys", "full", "set_full", "after_set_full", "set_submodule_keyed"]
        for name in [*names, "submodule_keyed_warnings"]:
            assert our[name] == their[name], name
        assert our["submodule_keyed_warnings"] == ["FutureWarning"]
        assert our["keys"] == keys
        assert our["after_set_full"] == our["full"]
        missing = [k for k in keys if k not in ("1.weight", "1.bias")]
        assert our["set_submodule_keyed"] == ("returns", (missing, []))
        # PyTorch pops the parameter's own name, which the state dict does not have.
        assert their["frozen"] == ("raises", "KeyError")
        assert our["frozen"] == ("returns", [k for k in keys if k != "1.weight"])
        assert our["frozen_other_modifiers"] == ("returns", keys)


# ---------------------------------------------------------------------- wrapper flat units


def _frozen_flat_unit() -> dict[str, Any]:
    from shard_runtime import FullyShardedDataParallel, ModuleWrapPolicy

    model = ToyNet(blocks=2)
    model.blocks[0].requires_grad_(False)
    wrapped = FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({ResidualBlock}), use_orig_params=False
    )
    options = shard_checkpoint.StateDictOptions(ignore_frozen_params=True)
    return {
        "sharded": list(shard_checkpoint.get_model_state_dict(wrapped, options=options)),
        "full": list(
            shard_checkpoint.get_model_state_dict(
                wrapped, options=dataclasses.replace(options, full_state_dict=True)
            )
        ),
    }


def test_ignore_frozen_params_drops_a_frozen_flat_unit(rank_pool: RankPool) -> None:
    """A wrapper unit frozen whole (use_orig_params=False: one flat parameter) loses its keys."""
    expected = [key for key in KEYS if not key.startswith("blocks.0.")]
    for result in rank_pool.run(_frozen_flat_unit, 2):
        assert result == {"sharded": expected, "full": expected}


def _head(model: nn.Module) -> nn.Parameter:
    (param,) = [p for n, p in model.named_parameters() if n.endswith("head.weight")]
    return param


def _frozen_after_training(impl: str, front: str) -> dict[str, Any]:
    """Train, freeze ``head.weight``, save, and load into a fresh model where it is frozen too."""
    warnings.simplefilter("ignore")
    api = _api(impl)
    model, optim = _build(impl, front, seed=0)
    _train_step(model, optim)
    head = _head(model)
    held = sorted(optim.state.get(head, {}))  # a wrapper rank may hold no piece of it
    head.requires_grad_(False)
    model_state, optim_state = api.get_state_dict(model, optim)
    saved = _plain(optim_state["state"]["head.weight"])
    fresh, fresh_optim = _build(impl, front, seed=1)
    param = _head(fresh)
    param.requires_grad_(False)
    api.set_state_dict(
        fresh, fresh_optim, model_state_dict=model_state, optim_state_dict=optim_state
    )
    _, reloaded = api.get_state_dict(fresh, fresh_optim)
    return {
        "held": held,
        "saved": saved,
        "loaded": sorted(fresh_optim.state.get(param, {})),
        "saved again": _plain(reloaded["state"].get("head.weight")),
    }


@pytest.mark.parametrize("front", ["fully_shard", "wrapper"])
def test_a_parameter_frozen_after_training_keeps_its_optimizer_state(
    rank_pool: RankPool, front: str
) -> None:
    """set_state_dict loads the saved state of a parameter frozen in the target, so unfreezing it
    later resumes its moments. PyTorch drops it (pytorch/pytorch#192202), which is asserted here
    too: when PyTorch fixes it, this test says so."""
    ours = rank_pool.run(_frozen_after_training, 2, "shard", front)
    theirs = rank_pool.run(_frozen_after_training, 2, "torch", front)
    for our, their in zip(ours, theirs, strict=True):
        assert sorted(our["saved"]) == ["exp_avg", "exp_avg_sq", "step"]
        assert our["saved"] == their["saved"]
        assert our["loaded"] == our["held"]
        assert our["saved again"] == our["saved"]
        assert their["loaded"] == []  # PyTorch's bug
        assert their["saved again"] is None
    assert any(our["held"] for our in ours)
