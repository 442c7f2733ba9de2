"""FullyShardedDataParallel's model state dicts side by side with PyTorch's FSDP1 (CPU, gloo).

What PyTorch's test_fsdp_state_dict pins, on nested wrappers over a root that
holds parameters of its own (``embed``, ``head``), an ignored module
(``side``), buffers, ``use_orig_params`` both ways and bf16 mixed precision:
every state-dict type and config, the keys, dtypes, shapes and values rank by
rank, the settings ``set_state_dict_type``/``get_state_dict_type`` report,
state dicts reached through a plain parent module, an inner wrapper and
``prefix=``, and loading each type into a fresh wrapper (PyTorch's into
shard's and shard's into PyTorch's where the formats are interchangeable)
followed by one more step with identical losses.

Each rank function runs one library (``impl``) or both, and returns plain
values; a sharded value is described by its global shape, this rank's offset,
shape and values, so PyTorch's ``ShardedTensor`` and shard's ``DTensor``
compare as what a user sees. Differences kept on purpose are asserted as
such and listed in tools/compat/compat_differences.toml. PyTorch bugs met on
this CPU-only host (the differential tester cannot reach them: it takes no
state dicts) are steered around and asserted where they show:

- ``offload_to_cpu=True`` state dicts (``FullStateDictConfig``): PyTorch
  frees the gathered CPU parameters it is copying ("setStorage: ... out of
  bounds for storage of size 0"), before or after the first forward; with
  ``rank0_only=True`` only rank 0 fails and the other ranks' next collective
  hangs, so PyTorch runs never ask for it (shard's offloaded values are
  compared with PyTorch's non-offloaded ones).
- ``LOCAL_STATE_DICT`` with ``use_orig_params=True``: PyTorch cannot load its
  own state dict back (it expects ``_flat_param`` keys that the model does not
  register).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shard_testing import RankPool
from shard_testing.compat import Impl, fsdp_namespace

TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT")


class Block(nn.Module):
    """A residual MLP block with a buffer: one unit of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 5)
        self.out = nn.Linear(5, 6)
        self.register_buffer("shift", torch.arange(6.0) / 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shift: torch.Tensor = self.shift
        return x + self.out(torch.relu(self.fc(x))) + shift


class Net(nn.Module):
    """``embed`` and ``head`` stay in the root unit, each block is a unit, ``side`` may be ignored.

    The root's flat buffer (54 + 21 elements) is uneven on 2 ranks, and with
    ``use_orig_params`` its alignment depends on the compute dtype.
    """

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 6)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(6, 3)
        self.side = nn.Linear(3, 3)
        self.register_buffer("scale", torch.full((3,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale: torch.Tensor = self.scale
        h = self.head(self.blocks(self.embed(x)))
        return self.side(h.to(self.side.weight.dtype)) * scale  # ignored: never cast


CASES = {
    # flat parameters, fp32, an ignored module
    "flat": {"orig": False, "mp": False},
    # original parameters, bf16 parameters and buffers, an ignored module
    "orig_bf16": {"orig": True, "mp": True},
}


def _wrap(impl: Impl, case: str, *, seed: int = 0, mesh: bool = False) -> nn.Module:
    ns = fsdp_namespace(impl)
    wrap = __import__(f"{ns.__name__}.wrap", fromlist=["wrap"])
    torch.manual_seed(seed)
    net = Net()
    kwargs: dict[str, Any] = {
        "auto_wrap_policy": wrap.ModuleWrapPolicy({Block}),
        "use_orig_params": CASES[case]["orig"],
        "ignored_modules": [net.side],
    }
    if CASES[case]["mp"]:
        kwargs["mixed_precision"] = ns.MixedPrecision(
            param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16
        )
    if mesh:
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["device_mesh"] = init_device_mesh("cpu", (dist.get_world_size(),))
    if impl == "torch":
        kwargs["device_id"] = torch.device("cpu")
    model: nn.Module = ns.FullyShardedDataParallel(net, **kwargs)
    return model


def _step(model: nn.Module, optim: torch.optim.Optimizer | None, k: int) -> float:
    """One step on this rank's batch ``k``; its loss (``optim=None``: no update)."""
    torch.manual_seed(100 + dist.get_rank() + 10 * k)
    loss = model(torch.rand(4, 8)).pow(2).sum()
    loss.backward()
    if optim is not None:
        optim.step()
        optim.zero_grad()
    else:
        model.zero_grad()
    return float(loss)


def _trained(impl: Impl, case: str, **kwargs: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _wrap(impl, case, **kwargs)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step(model, optim, 0)
    return model, optim


def _value(value: Any) -> Any:
    """What a user sees of a state-dict value: plain values as they are."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(value, DTensor):
        local = value.to_local()
        _, offset = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        pieces = [(tuple(offset), local)] if local.numel() else []
        return _sharded("DTensor", value.dtype, tuple(value.shape), pieces)
    if isinstance(value, ShardedTensor):
        pieces = [(tuple(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]
        pieces = [(o, t) for o, t in pieces if t.numel()]
        return _sharded("ShardedTensor", value.dtype, tuple(value.size()), pieces)
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), value.device.type, value.tolist())
    return value


def _sharded(kind: str, dtype: torch.dtype, shape: tuple[int, ...], pieces: list[Any]) -> Any:
    return (
        "sharded",
        kind,
        str(dtype),
        shape,
        [(offset, tuple(t.shape), t.device.type, t.tolist()) for offset, t in pieces],
    )


def _described(state: dict[str, Any]) -> dict[str, Any]:
    return {key: _value(value) for key, value in state.items()}


def _outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return ("ok", fn())
    except Exception as exc:
        return (type(exc).__name__, str(exc))


def _state_dict(model: nn.Module, ns: Any, kind: str, config: Any = None) -> dict[str, Any]:
    fsdp = ns.FullyShardedDataParallel
    with fsdp.state_dict_type(model, ns.StateDictType[kind], config):
        state: dict[str, Any] = model.state_dict()
    return state


def _padding(model: nn.Module) -> dict[str, list[bool]]:
    """shard only: which local elements of each LOCAL ``_flat_param`` are padding."""
    from shard_runtime.plumbing import clean_fqn, flat_units

    names = {id(m): clean_fqn(n) for n, m in model.named_modules()}
    out: dict[str, list[bool]] = {}
    for unit in flat_units(model):
        prefix = names[id(unit.wrapper)]
        total = unit.world * unit.shard_numel
        pad = torch.ones(total, dtype=torch.bool)
        for offset, spec in zip(unit.layout.offsets, unit.layout.params, strict=True):
            pad[offset : offset + spec.numel] = False
        n = unit.shard_numel
        out[f"{prefix}._flat_param" if prefix else "_flat_param"] = pad[
            unit.rank * n : (unit.rank + 1) * n
        ].tolist()
    return out


def _model_state_dicts(impl: Impl, case: str) -> dict[str, Any]:
    """Every state-dict type and config before and after a step, and loading each back."""
    warnings.simplefilter("ignore")  # PyTorch deprecates state_dict_type and ShardedTensor
    ns = fsdp_namespace(impl)
    fsdp = ns.FullyShardedDataParallel
    out: dict[str, Any] = {}
    fresh = _wrap(impl, case)
    out["before_forward"] = {kind: _described(_state_dict(fresh, ns, kind)) for kind in TYPES}
    model, _ = _trained(impl, case)
    offloads = (False,) if impl == "torch" else (False, True)  # PyTorch's offload fails on CPU
    for offload in offloads:
        for rank0_only in (False, True):
            config = ns.FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only)
            state = _state_dict(model, ns, "FULL_STATE_DICT", config)
            out[f"full_offload{offload}_rank0{rank0_only}"] = _described(state)
    for offload in (False, True):
        for dtensor in (False, True) if impl == "shard" else (False,):
            config = ns.ShardedStateDictConfig(offload_to_cpu=offload, _use_dtensor=dtensor)
            state = _state_dict(model, ns, "SHARDED_STATE_DICT", config)
            out[f"sharded_offload{offload}_dtensor{dtensor}"] = _described(state)
        config = ns.LocalStateDictConfig(offload_to_cpu=offload)
        out[f"local_offload{offload}"] = _described(
            _state_dict(model, ns, "LOCAL_STATE_DICT", config)
        )
    if impl == "shard":
        out["padding"] = _padding(model)
    # The settings, as get/set_state_dict_type report them.
    settings = [repr(fsdp.get_state_dict_type(model))]
    settings.append(repr(fsdp.set_state_dict_type(model, ns.StateDictType.SHARDED_STATE_DICT)))
    settings.append(repr(fsdp.get_state_dict_type(model)))
    settings.append(repr(fsdp.set_state_dict_type(model, ns.StateDictType.FULL_STATE_DICT)))
    out["settings"] = [s.replace("shard_runtime._state_dict_type.", "") for s in settings]
    # Each type loaded into a fresh wrapper, then the next step's loss on both.
    for kind in TYPES:
        state = _state_dict(model, ns, kind)

        def load(kind: str = kind, state: dict[str, Any] = state) -> tuple[Any, ...]:
            target = _wrap(impl, case, seed=1)
            with fsdp.state_dict_type(target, ns.StateDictType[kind]):
                result = target.load_state_dict(state)
            return (result.missing_keys, result.unexpected_keys, _step(target, None, 1))

        out[f"load_{kind}"] = _outcome(load)
    out["next_loss"] = _step(model, None, 1)
    return out


@pytest.fixture(scope="module", params=list(CASES))
def state_dicts(request: pytest.FixtureRequest, rank_pool: RankPool) -> dict[str, Any]:
    case = request.param
    return {
        "case": case,
        **{impl: rank_pool.run(_model_state_dicts, 2, impl, case) for impl in ("torch", "shard")},
    }


def _pairs(results: dict[str, Any]) -> list[tuple[int, dict[str, Any], dict[str, Any]]]:
    return [
        (rank, theirs, ours)
        for rank, (theirs, ours) in enumerate(zip(results["torch"], results["shard"], strict=True))
    ]


def _param_names() -> list[str]:
    """The parameters the wrappers manage (``side`` is ignored)."""
    return [n for n, _ in Net().named_parameters() if not n.startswith("side.")]


def test_full_state_dicts_match(state_dicts: dict[str, Any]) -> None:
    """FULL_STATE_DICT, before and after a step, rank0_only both ways: PyTorch's keys (the
    unwrapped model's, in its order), dtypes (fp32 parameters and buffers under bf16 mixed
    precision), shapes, devices and values on every rank; shard's offload_to_cpu=True gives the
    same values. Under rank0_only PyTorch leaves the ignored module's parameters on the other
    ranks; shard leaves them {} (a deliberate difference)."""
    plain_keys = list(Net().state_dict())
    for rank, theirs, ours in _pairs(state_dicts):
        assert (
            ours["before_forward"]["FULL_STATE_DICT"] == theirs["before_forward"]["FULL_STATE_DICT"]
        )
        full = theirs["full_offloadFalse_rank0False"]
        assert list(full) == plain_keys
        assert {v[1] for v in full.values()} == {"torch.float32"}
        assert ours["full_offloadFalse_rank0False"] == full
        assert ours["full_offloadTrue_rank0False"] == full  # on the CPU either way
        rank0_only = theirs["full_offloadFalse_rank0True"]
        if rank == 0:
            assert rank0_only == full
        else:
            assert list(rank0_only) == ["side.weight", "side.bias"]
            rank0_only = {}
        assert ours["full_offloadFalse_rank0True"] == rank0_only
        assert ours["full_offloadTrue_rank0True"] == rank0_only


def _as_dtensor(described: dict[str, Any]) -> dict[str, Any]:
    """PyTorch's ShardedTensor descriptions as the DTensors shard gives (same pieces)."""
    return {
        k: (v[0], "DTensor", *v[2:]) if v[0] == "sharded" and v[1] == "ShardedTensor" else v
        for k, v in described.items()
    }


def test_sharded_state_dicts_match(state_dicts: dict[str, Any]) -> None:
    """SHARDED_STATE_DICT, before and after a step, offload_to_cpu both ways: PyTorch's keys,
    and each parameter's global shape, dtype and this rank's torch.chunk piece (offset, shape,
    values), rank by rank; buffers plain. PyTorch gives ShardedTensors (DTensors only with a
    device_mesh); shard gives DTensors whatever _use_dtensor says (a deliberate difference)."""
    params = _param_names()
    for _, theirs, ours in _pairs(state_dicts):
        before = theirs["before_forward"]["SHARDED_STATE_DICT"]
        assert ours["before_forward"]["SHARDED_STATE_DICT"] == _as_dtensor(before)
        for offload in (False, True):
            sharded = theirs[f"sharded_offload{offload}_dtensorFalse"]
            assert [k for k, v in sharded.items() if v[0] == "sharded"] == params
            assert {v[1] for v in sharded.values() if v[0] == "sharded"} == {"ShardedTensor"}
            for dtensor in (False, True):
                assert ours[f"sharded_offload{offload}_dtensor{dtensor}"] == _as_dtensor(sharded)


def _unpadded(described: dict[str, Any], padding: dict[str, list[bool]]) -> dict[str, Any]:
    """LOCAL descriptions with each flat shard's padding elements set to None."""
    out = dict(described)
    for key, pad in padding.items():
        kind, cls, dtype, shape, pieces = out[key]
        masked = [
            (offset, size, device, [None if p else v for v, p in zip(values, pad, strict=False)])
            for offset, size, device, values in pieces
        ]
        out[key] = (kind, cls, dtype, shape, masked)
    return out


def test_local_state_dicts_match(state_dicts: dict[str, Any]) -> None:
    """LOCAL_STATE_DICT: each unit's flat shard under <wrapper>._flat_param with PyTorch's global
    size (the unpadded flat buffer; with use_orig_params PyTorch's padded one) and this rank's
    piece and values (PyTorch leaves alignment padding uninitialised: not compared), buffers as
    the model holds them (bf16 under mixed precision, as PyTorch). With use_orig_params PyTorch
    also lists every parameter's local piece, and cannot load that back; shard gives the flat
    shards only (a deliberate difference)."""
    case = state_dicts["case"]
    params = set(_param_names())
    for _, theirs, ours in _pairs(state_dicts):
        padding = ours["padding"]
        for name in ("local_offloadFalse", "local_offloadTrue"):
            local = _as_dtensor(theirs[name])
            if CASES[case]["orig"]:
                assert set(local) - set(ours[name]) == params
                local = {k: v for k, v in local.items() if k not in params}
                assert sorted(local) == sorted(ours[name])
                local = {k: local[k] for k in ours[name]}
            assert list(ours[name]) == list(local)
            assert _unpadded(ours[name], padding) == _unpadded(local, padding)
        buffers = {k: v[1] for k, v in theirs["local_offloadFalse"].items() if v[0] == "tensor"}
        expected = "torch.bfloat16" if CASES[case]["mp"] else "torch.float32"
        assert {buffers[k] for k in ("scale", "blocks.0.shift", "blocks.1.shift")} == {expected}


def test_settings_match(state_dicts: dict[str, Any]) -> None:
    """get_state_dict_type and set_state_dict_type report PyTorch's settings (type, config and
    optimizer config, their defaults) and set_state_dict_type returns the previous ones."""
    for _, theirs, ours in _pairs(state_dicts):
        assert ours["settings"] == theirs["settings"]
    assert "SHARDED_STATE_DICT" in state_dicts["torch"][0]["settings"][2]


def test_each_type_loads_back_and_trains_alike(state_dicts: dict[str, Any]) -> None:
    """Each type's state dict loads into a fresh wrapper (no missing or unexpected key) whose
    next loss equals the source model's, as under PyTorch; PyTorch's LOCAL with
    use_orig_params cannot load its own state dict, shard's can."""
    orig = CASES[state_dicts["case"]]["orig"]
    for _, theirs, ours in _pairs(state_dicts):
        for kind in TYPES:
            loaded = ("ok", ([], [], ours["next_loss"]))
            assert ours[f"load_{kind}"] == loaded
            if kind == "LOCAL_STATE_DICT" and orig:
                assert theirs[f"load_{kind}"][0] == "RuntimeError"
                assert 'Unexpected key(s) in state_dict: "_flat_param"' in theirs[f"load_{kind}"][1]
            else:
                assert theirs[f"load_{kind}"] == loaded
        assert ours["next_loss"] == theirs["next_loss"]


def _cross_loads(case: str) -> dict[str, Any]:
    """State dicts of one library's wrapper loaded into the other's; both libraries in one run.

    FULL is plain tensors; SHARDED moves as DTensors between wrappers given a
    device_mesh (PyTorch then gives DTensors); PyTorch's ShardedTensors
    (SHARDED and LOCAL without a mesh) load into shard's wrapper.
    """
    warnings.simplefilter("ignore")
    out: dict[str, Any] = {}
    routes = [
        ("FULL_STATE_DICT", "torch", "shard", False),
        ("FULL_STATE_DICT", "shard", "torch", False),
        ("SHARDED_STATE_DICT", "torch", "shard", True),
        ("SHARDED_STATE_DICT", "shard", "torch", True),
        ("SHARDED_STATE_DICT", "torch", "shard", False),  # ShardedTensors
    ]
    if not CASES[case]["orig"]:  # with use_orig_params PyTorch's LOCAL holds more (see above)
        routes.append(("LOCAL_STATE_DICT", "torch", "shard", False))  # ShardedTensors
    for kind, source, target, mesh in routes:
        model, _ = _trained(source, case, mesh=mesh)
        state = _state_dict(model, fsdp_namespace(source), kind)
        loaded = _wrap(target, case, seed=1, mesh=mesh)
        ns = fsdp_namespace(target)
        with ns.FullyShardedDataParallel.state_dict_type(loaded, ns.StateDictType[kind]):
            result = loaded.load_state_dict(state)
        out[f"{kind} {source}->{target} mesh={mesh}"] = (
            result.missing_keys,
            result.unexpected_keys,
            _step(loaded, None, 1),
            _step(model, None, 1),
        )
    # One element on two ranks: rank 1's ShardedTensor holds no piece (PyTorch's
    # test_local_state_dict_with_empty_ranks).
    for kind in ("SHARDED_STATE_DICT", "LOCAL_STATE_DICT"):
        models = {}
        for impl in ("torch", "shard"):
            ns = fsdp_namespace(impl)
            kwargs = {"device_id": torch.device("cpu")} if impl == "torch" else {}
            torch.manual_seed(impl == "shard")
            models[impl] = ns.FullyShardedDataParallel(nn.Linear(1, 1, bias=False), **kwargs)
        state = _state_dict(models["torch"], fsdp_namespace("torch"), kind)
        shard_ns = fsdp_namespace("shard")
        with shard_ns.FullyShardedDataParallel.state_dict_type(
            models["shard"], shard_ns.StateDictType[kind]
        ):
            result = models["shard"].load_state_dict(state)
        out[f"{kind} one element"] = (
            result.missing_keys,
            result.unexpected_keys,
            float(models["shard"](torch.ones(1))),
            float(models["torch"](torch.ones(1))),
        )
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_state_dicts_load_across_libraries(rank_pool: RankPool, case: str) -> None:
    """PyTorch's FULL state dict loads into shard's wrapper and shard's into PyTorch's, SHARDED
    DTensors both ways (wrappers given a device_mesh), and PyTorch's ShardedTensors (SHARDED,
    and LOCAL for flat parameters, also where a rank holds no piece) into shard's: no missing
    or unexpected key, and the next loss (output) is the source model's."""
    for result in rank_pool.run(_cross_loads, 2, case):
        assert len(result) == 7 + (not CASES[case]["orig"])
        for route, (missing, unexpected, loss, source_loss) in result.items():
            assert (route, missing, unexpected, loss) == (route, [], [], source_loss)


def _through_parents(impl: Impl) -> dict[str, Any]:
    """State dicts of a wrapper inside a plain module, of an inner wrapper, and with prefix=."""
    warnings.simplefilter("ignore")
    ns = fsdp_namespace(impl)
    fsdp = ns.FullyShardedDataParallel
    out: dict[str, Any] = {}
    model, _ = _trained(impl, "flat")
    holder = nn.Sequential(model)
    for kind in TYPES:
        state = _state_dict(holder, ns, kind)
        out[f"holder {kind}"] = _described(state)
        out[f"inner {kind}"] = _described(_state_dict(model.blocks[0], ns, kind))
        target = nn.Sequential(_wrap(impl, "flat", seed=1))
        with fsdp.state_dict_type(target, ns.StateDictType[kind]):
            result = target.load_state_dict(state)
        out[f"holder load {kind}"] = (result.missing_keys, result.unexpected_keys)
        out[f"holder loss {kind}"] = _step(target, None, 1)
    out["prefix"] = list(model.state_dict(prefix="outer."))
    # strict=False reports the keys without the wrapper's segments (PyTorch's test)
    state = model.state_dict()
    del state["blocks.0.fc.bias"]
    state["unexpected"] = torch.ones(1)
    result = model.load_state_dict(state, strict=False)
    out["strict_false"] = (result.missing_keys, result.unexpected_keys)
    out["loss"] = _step(model, None, 1)
    return out


def test_state_dicts_through_a_parent_an_inner_wrapper_and_a_prefix(rank_pool: RankPool) -> None:
    """A plain module holding the wrapper gets the wrapper's keys under its name and loads them
    back (DistributedDataParallel(FSDP(...)) is such a parent), an inner wrapper gives its own
    unit's keys, prefix= prefixes them and strict=False names missing and unexpected keys
    without wrapper segments, for every type, as under PyTorch (ShardedTensors there)."""
    theirs = rank_pool.run(_through_parents, 2, "torch")
    ours = rank_pool.run(_through_parents, 2, "shard")
    for their, our in zip(theirs, ours, strict=True):
        assert our == {k: _as_dtensor(v) if isinstance(v, dict) else v for k, v in their.items()}
    assert list(theirs[0]["holder FULL_STATE_DICT"])[:3] == [
        "0.scale",
        "0.embed.weight",
        "0.embed.bias",
    ]
    assert list(theirs[0]["inner LOCAL_STATE_DICT"]) == ["_flat_param", "shift"]
    assert theirs[0]["strict_false"] == (["blocks.0.fc.bias"], ["unexpected"])
    for rank in theirs:
        assert {rank[f"holder loss {kind}"] for kind in TYPES} == {rank["loss"]}


def _settings_errors(impl: Impl) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    ns = fsdp_namespace(impl)
    fsdp = ns.FullyShardedDataParallel
    full, sharded = ns.StateDictType.FULL_STATE_DICT, ns.StateDictType.SHARDED_STATE_DICT
    model = _wrap(impl, "flat")
    out: dict[str, Any] = {
        "wrong_config": _outcome(
            lambda: fsdp.set_state_dict_type(model, full, ns.LocalStateDictConfig())
        ),
        "wrong_optim_config": _outcome(
            lambda: fsdp.set_state_dict_type(model, full, None, ns.ShardedOptimStateDictConfig())
        ),
    }
    fsdp.set_state_dict_type(model.blocks[0], sharded)
    out["get_mixed"] = _outcome(lambda: fsdp.get_state_dict_type(model))
    out["set_mixed"] = _outcome(lambda: repr(fsdp.set_state_dict_type(model, full)))

    def raising() -> None:
        with fsdp.state_dict_type(model, sharded):
            raise KeyError("in the block")

    for wrapper in reversed(fsdp.fsdp_modules(model)):  # innermost first: PyTorch accepts it
        fsdp.set_state_dict_type(wrapper, full)
    out["block_raises"] = _outcome(raising)
    out["after_raise"] = fsdp.get_state_dict_type(model).state_dict_type.name
    out["no_wrapper"] = _outcome(lambda: fsdp.get_state_dict_type(nn.Linear(2, 2)))
    meshed = _wrap(impl, "flat", mesh=True)
    out["LOCAL with a device_mesh"] = _outcome(
        lambda: list(_state_dict(meshed, ns, "LOCAL_STATE_DICT"))
    )
    # Last, on a model of their own: PyTorch fails these on every rank alike.
    trained, _ = _trained(impl, "flat")
    dtensors = ns.ShardedStateDictConfig(_use_dtensor=True)
    out["_use_dtensor without a device_mesh"] = _outcome(
        lambda: type(_state_dict(trained, ns, "SHARDED_STATE_DICT", dtensors)["head.weight"])
    )
    trained, _ = _trained(impl, "flat")
    offloaded = ns.FullStateDictConfig(offload_to_cpu=True)
    out["offload_to_cpu"] = _outcome(
        lambda: list(_state_dict(trained, ns, "FULL_STATE_DICT", offloaded))
    )
    return out


def test_settings_errors(rank_pool: RankPool) -> None:
    """A config of another type's kind is PyTorch's RuntimeError with its words; wrappers with
    different settings make get_state_dict_type PyTorch's AssertionError with its words, naming
    the wrappers. Deliberately different: set_state_dict_type resets mixed settings (PyTorch
    refuses when the types differ), the state_dict_type block restores the settings when it
    raises (PyTorch keeps the new ones), a model without wrappers is a ValueError (PyTorch
    returns None), LOCAL works with a device_mesh (PyTorch refuses) and SHARDED gives DTensors
    with _use_dtensor=True and no device_mesh (PyTorch: AttributeError). PyTorch's
    offload_to_cpu=True fails on this CPU-only host (its bug); shard's works."""
    (theirs, _), (ours, _) = (
        rank_pool.run(_settings_errors, 2, "torch"),
        rank_pool.run(_settings_errors, 2, "shard"),
    )
    for key in ("wrong_config", "wrong_optim_config", "get_mixed"):
        assert ours[key][0] == theirs[key][0]
    assert theirs["wrong_config"][1].startswith("Expected state_dict_config of type")
    assert ours["wrong_config"][1] == (
        "Expected state_dict_config of type FullStateDictConfig but got LocalStateDictConfig: "
        "FULL_STATE_DICT takes a FullStateDictConfig; pass FullStateDictConfig(...) or None for "
        "its defaults"
    )
    assert ours["wrong_optim_config"][1].startswith(
        "Expected optim_state_dict_config of type FullOptimStateDictConfig but got "
        "ShardedOptimStateDictConfig"
    )
    assert theirs["get_mixed"][0] == "AssertionError"
    assert theirs["get_mixed"][1].startswith("All FSDP modules must have the same state dict")
    assert ours["get_mixed"][1].startswith(
        "All FSDP modules must have the same state dict settings: the wrapper of 'blocks.0' has "
        "SHARDED_STATE_DICT with ShardedStateDictConfig(offload_to_cpu=False, _use_dtensor=False) "
        "but the one of the model has FULL_STATE_DICT"
    )
    assert theirs["set_mixed"] == (
        "AssertionError",
        "All FSDP modules should have the same state_dict_type.",
    )
    assert ours["set_mixed"][0] == "ok"
    assert theirs["block_raises"] == ours["block_raises"] == ("KeyError", "'in the block'")
    assert (theirs["after_raise"], ours["after_raise"]) == ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
    assert theirs["LOCAL with a device_mesh"][0] == "RuntimeError"
    assert (
        "DeviceMesh is not compatible with LOCAL_STATE_DICT"
        in theirs["LOCAL with a device_mesh"][1]
    )
    assert ours["LOCAL with a device_mesh"] == (
        "ok",
        [
            "_flat_param",
            "scale",
            "blocks.0._flat_param",
            "blocks.0.shift",
            "blocks.1._flat_param",
            "blocks.1.shift",
            "side.weight",
            "side.bias",
        ],
    )
    assert theirs["_use_dtensor without a device_mesh"][0] == "AttributeError"
    assert ours["_use_dtensor without a device_mesh"][1].__name__ == "DTensor"
    assert theirs["offload_to_cpu"][0] == "RuntimeError"  # PyTorch's bug on a CPU-only host
    assert "out of bounds for storage of size 0" in theirs["offload_to_cpu"][1]
    assert ours["offload_to_cpu"] == ("ok", list(Net().state_dict()))
    assert theirs["no_wrapper"] == ("ok", None)
    assert ours["no_wrapper"] == (
        "ValueError",
        "get_state_dict_type: Linear holds no FullyShardedDataParallel; pass a wrapped model",
    )


# ------------------------------------------------------------------ optimizer state dicts

OPTIM_ROUTES = (
    "optim_state_dict FULL",
    "optim_state_dict FULL rank0_only",
    "optim_state_dict SHARDED",
    "optim_state_dict LOCAL",
    "full_optim_state_dict + scatter_full_optim_state_dict",
    "full_optim_state_dict + shard_full_optim_state_dict",
    "sharded_optim_state_dict + flatten_sharded_optim_state_dict",
    "rekey_optim_state_dict to PARAM_ID and back + shard_full_optim_state_dict",
)


def _nested(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _nested(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_nested(v) for v in value)
    return _value(value)


def _plain_net() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The unwrapped model and an optimizer over it, as rekey_optim_state_dict's docs use them."""
    torch.manual_seed(0)
    net = Net()
    return net, torch.optim.AdamW(net.parameters(), lr=0.01)


def _optim_state_dicts(impl: Impl, case: str) -> dict[str, Any]:
    """Every optimizer state-dict method after two AdamW steps, and each round trip."""
    warnings.simplefilter("ignore")
    ns = fsdp_namespace(impl)
    fsdp = ns.FullyShardedDataParallel
    kinds = ns.StateDictType
    model, optim = _trained(impl, case)
    _step(model, optim, 1)
    out: dict[str, Any] = {}

    def optim_state_dict(kind: str, config: Any = None) -> dict[str, Any]:
        with fsdp.state_dict_type(model, kinds[kind], None, config):
            state: dict[str, Any] = fsdp.optim_state_dict(model, optim)
        return state

    for rank0_only in (False, True):
        config = ns.FullOptimStateDictConfig(rank0_only=rank0_only)
        out[f"FULL rank0_only={rank0_only}"] = _nested(optim_state_dict("FULL_STATE_DICT", config))
    for offload in (False, True):
        config = ns.ShardedOptimStateDictConfig(offload_to_cpu=offload)
        out[f"SHARDED offload={offload}"] = _nested(optim_state_dict("SHARDED_STATE_DICT", config))
    out["LOCAL"] = _nested(optim_state_dict("LOCAL_STATE_DICT"))
    out["full_optim_state_dict"] = _nested(fsdp.full_optim_state_dict(model, optim))
    full = fsdp.full_optim_state_dict(model, optim, rank0_only=False)
    out["full_optim_state_dict rank0_only=False"] = _nested(full)
    out["sharded_optim_state_dict"] = _nested(fsdp.sharded_optim_state_dict(model, optim))
    plain, plain_optim = _plain_net()
    by_id = fsdp.rekey_optim_state_dict(full, ns.OptimStateKeyType.PARAM_ID, plain)
    out["rekey PARAM_ID"] = _nested(by_id)
    out["rekey PARAM_ID with the wrapped model"] = _outcome(
        lambda: _nested(fsdp.rekey_optim_state_dict(full, ns.OptimStateKeyType.PARAM_ID, model))
    )
    plain_optim.load_state_dict(by_id)
    by_name = fsdp.rekey_optim_state_dict(
        plain_optim.state_dict(), ns.OptimStateKeyType.PARAM_NAME, plain
    )
    out["rekey PARAM_NAME"] = _nested(by_name)

    def loadable(route: str, target: nn.Module, target_optim: Any) -> Any:
        if route.startswith("optim_state_dict"):
            kind = route.split()[1] + "_STATE_DICT"
            config = ns.FullOptimStateDictConfig(rank0_only=True) if "rank0" in route else None
            with fsdp.state_dict_type(model, kinds[kind], None, config):
                state = fsdp.optim_state_dict(model, optim)
            with fsdp.state_dict_type(target, kinds[kind], None, config):
                return fsdp.optim_state_dict_to_load(target, target_optim, state)
        if route.startswith("full_optim_state_dict + scatter"):
            state = fsdp.full_optim_state_dict(model, optim)
            state = state if dist.get_rank() == 0 else None
            return fsdp.scatter_full_optim_state_dict(state, target, optim=target_optim)
        if route.startswith("full_optim_state_dict + shard"):
            return fsdp.shard_full_optim_state_dict(full, target, optim=target_optim)
        if route.startswith("sharded_optim_state_dict"):
            state = fsdp.sharded_optim_state_dict(model, optim)
            return fsdp.flatten_sharded_optim_state_dict(state, target, target_optim)
        return fsdp.shard_full_optim_state_dict(by_name, target, optim=target_optim)

    model_state = _state_dict(model, ns, "FULL_STATE_DICT")
    for route in OPTIM_ROUTES:
        target, target_optim = _trained(impl, case, seed=1)
        target.load_state_dict(model_state)
        # A copy: state of the ignored module's parameters is the source optimizer's own
        # tensors (under PyTorch too), which the target's steps would change in place.
        target_optim.load_state_dict(copy.deepcopy(loadable(route, target, target_optim)))
        out[route] = [_step(target, target_optim, k) for k in (2, 3)]
    out["continued"] = [_step(model, optim, k) for k in (2, 3)]
    return out


@pytest.fixture(scope="module", params=list(CASES))
def optim_state_dicts(request: pytest.FixtureRequest, rank_pool: RankPool) -> dict[str, Any]:
    case = request.param
    return {
        "case": case,
        **{impl: rank_pool.run(_optim_state_dicts, 2, impl, case) for impl in ("torch", "shard")},
    }


def _without_exp_avg(state: dict[str, Any]) -> dict[str, Any]:
    return {
        **state,
        "state": {
            k: {n: v for n, v in s.items() if n != "exp_avg"} for k, s in state["state"].items()
        },
    }


def test_optimizer_state_dicts_match(optim_state_dicts: dict[str, Any]) -> None:
    """optim_state_dict (FULL with rank0_only both ways, SHARDED with offload_to_cpu both ways,
    LOCAL, which PyTorch gives in SHARDED form), full_optim_state_dict (rank0_only both ways),
    sharded_optim_state_dict and rekey_optim_state_dict (PARAM_ID for the unwrapped model and
    back): PyTorch's parameter names, state names, param_groups, and each value's dtype, shape
    and values (this rank's torch.chunk piece when sharded), rank by rank, in PyTorch's order
    (which depends on use_orig_params: by name, or the flat parameters' order with their
    elementwise state first). With use_orig_params PyTorch's full state gets every exp_avg
    wrong on this CPU host (a PyTorch bug, see the next test)."""
    orig = CASES[optim_state_dicts["case"]]["orig"]
    for _, theirs, ours in _pairs(optim_state_dicts):
        for key, their in theirs.items():
            if key in OPTIM_ROUTES or key in ("continued", "rekey PARAM_ID with the wrapped model"):
                continue
            our = ours[key]
            if isinstance(their.get("state"), dict):
                their = {**their, "state": {k: _as_dtensor(v) for k, v in their["state"].items()}}
            if orig and ("FULL" in key or key.startswith(("full", "rekey"))) and their.get("state"):
                their, our = _without_exp_avg(their), _without_exp_avg(our)
            assert our == their, key
            if isinstance(their.get("state"), dict):
                assert list(our["state"]) == list(their["state"]), key
                for name, entry in their["state"].items():
                    assert list(our["state"][name]) == list(entry), (key, name)
    state = optim_state_dicts["torch"][1]
    assert state["full_optim_state_dict"] == {}  # rank0_only=True by default
    assert sorted(state["SHARDED offload=False"]["state"]) == sorted(dict(Net().named_parameters()))


def test_optimizer_state_dicts_round_trip(optim_state_dicts: dict[str, Any]) -> None:
    """Each way of saving and loading optimizer state (optim_state_dict_to_load for every type,
    scatter_full_/shard_full_/flatten_sharded_optim_state_dict, rekeying through a plain
    optimizer) resumes training exactly: the next two losses equal the source model's, and
    PyTorch's. The ways that send rank 0's state to every rank give the other ranks rank 0's
    state of the ignored module (its own on each rank), under both libraries. With
    use_orig_params PyTorch's full optimizer state holds a wrong exp_avg (its sharded one is
    right), so its losses after the full ways differ; shard's do not."""
    orig = CASES[optim_state_dicts["case"]]["orig"]
    for rank, theirs, ours in _pairs(optim_state_dicts):
        assert ours["continued"] == theirs["continued"]
        for route in OPTIM_ROUTES:
            from_rank0 = "rank0_only" in route or "scatter" in route
            if rank == 0 or not from_rank0:
                assert (route, ours[route]) == (route, ours["continued"])
            else:
                assert ours[route] != ours["continued"]
            if orig and ("FULL" in route or "full_optim" in route or "rekey" in route):
                assert theirs[route] != ours[route]  # PyTorch's bug, see the next test
            else:
                assert (route, ours[route]) == (route, theirs[route])


def test_pytorch_full_optimizer_state_with_original_parameters_is_wrong(
    optim_state_dicts: dict[str, Any],
) -> None:
    """Documents a PyTorch bug met on CPU (the differential tester takes no optimizer state
    dicts, so it cannot reach it): with use_orig_params=True, FSDP1's full optimizer state holds
    each managed parameter's exp_avg_sq in place of its exp_avg (the gathered buffer of the
    first state is reused for the second: on the CPU its "offload" is no copy), while training
    itself matches shard's (same losses, same sharded state); shard's full state resumes
    exactly (previous test)."""
    orig = CASES[optim_state_dicts["case"]]["orig"]
    theirs = optim_state_dicts["torch"][0]["FULL rank0_only=False"]["state"]
    ours = optim_state_dicts["shard"][0]["FULL rank0_only=False"]["state"]
    for name in _param_names():  # the ignored module's state is right
        # With flat parameters PyTorch's is right (and equals shard's, tested above).
        assert (theirs[name]["exp_avg"] == theirs[name]["exp_avg_sq"]) is orig
        assert ours[name]["exp_avg"] != ours[name]["exp_avg_sq"]
        assert {n: v for n, v in ours[name].items() if n != "exp_avg"} == {
            n: v for n, v in theirs[name].items() if n != "exp_avg"
        }


def test_rekey_takes_the_wrapped_model_too(optim_state_dicts: dict[str, Any]) -> None:
    """rekey_optim_state_dict(..., PARAM_ID, model) numbers the parameters as for the unwrapped
    model also when given the wrapped one; PyTorch needs the unwrapped model: with flat
    parameters it raises (a deliberate difference)."""
    key = "rekey PARAM_ID with the wrapped model"
    for _, theirs, ours in _pairs(optim_state_dicts):
        assert ours[key] == ("ok", ours["rekey PARAM_ID"])
        if not CASES[optim_state_dicts["case"]]["orig"]:
            assert theirs[key][0] == "RuntimeError"
            assert theirs[key][1].startswith("Each parameter should only map to one parameter")


def _checkpointed_keys(impl: Impl, inside: bool, orig: bool) -> dict[str, Any]:
    """State-dict keys of a wrapped model whose blocks run under ``checkpoint_wrapper``.

    ``inside``: the wrapper around a block that stays in the root unit; otherwise
    around a block's own unit, the order ``apply_activation_checkpointing`` gives.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    warnings.simplefilter("ignore")
    ns = fsdp_namespace(impl)
    fsdp = ns.FullyShardedDataParallel
    torch.manual_seed(0)
    net = Net()
    kwargs: dict[str, Any] = {"use_orig_params": orig}
    if impl == "torch":
        kwargs["device_id"] = torch.device("cpu")
    for index, block in enumerate(list(net.blocks)):
        net.blocks[index] = checkpoint_wrapper(block if inside else fsdp(block, **kwargs))
    model = fsdp(net, **kwargs)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step(model, optim, 0)
    out: dict[str, Any] = {}
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        with fsdp.state_dict_type(model, ns.StateDictType[kind]):
            state = model.state_dict()
            out[kind] = list(state)
            out[f"optim {kind}"] = list(fsdp.optim_state_dict(model, optim)["state"])
            out[f"load {kind}"] = _outcome(lambda state=state: str(model.load_state_dict(state)))
    return out


@pytest.mark.parametrize("orig", [True, False], ids=["orig", "flat"])
@pytest.mark.parametrize("inside", [True, False], ids=["inside-root-unit", "around-own-unit"])
def test_checkpoint_wrapper_segments_stay_out_of_the_keys(
    rank_pool: RankPool, inside: bool, orig: bool
) -> None:
    """Activation checkpointing by checkpoint_wrapper: model and optimizer state dicts (FULL,
    SHARDED) are keyed by the plain model's names, as PyTorch's, and load back."""
    theirs = rank_pool.run(_checkpointed_keys, 2, "torch", inside, orig)
    ours = rank_pool.run(_checkpointed_keys, 2, "shard", inside, orig)
    assert ours == theirs
    plain = [name for name, _ in Net().named_parameters()]
    assert [k for k in ours[0]["FULL_STATE_DICT"] if k in plain] == plain
    assert ours[0]["load FULL_STATE_DICT"] == ("ok", "<All keys matched successfully>")
