"""torchao's NF4 and float8 weights through shard's fully_shard, beside PyTorch's.

Both subclasses plug into FSDP2's all-gather through two methods of the
sharded local tensor: ``fsdp_pre_all_gather`` says what goes on the wire,
``fsdp_post_all_gather`` rebuilds the unsharded parameter from what came
back. Each test trains the same model twice on the same 2 gloo ranks, with
PyTorch's ``fully_shard`` and then with shard's, and requires equal losses,
parameters, hook calls and all-gathered bytes per step; the float8 test of a
unit PyTorch cannot gather on gloo compares shard with a one-process run.

[Note: counting the same way for both]
Hook calls are counted by wrapping the subclass's two methods, all-gathered
bytes by wrapping the ``torch.distributed`` all-gather functions both
engines call (``all_gather_single`` today, its older name
``all_gather_into_tensor``, and ``all_gather`` for shard's chunked gather of
large outputs): the output's bytes and dtype per call. Both engines look
these up on ``torch.distributed`` at each call, and the hooks on the local
tensor at each all-gather, so wrapping them around the steps sees every call. shard's
lazy init gathers the model fingerprint over the mesh, so every run first
does one forward and backward and drops its gradients (no parameter
changes), and counts from the first training step on. The warm-up has a
backward because after a forward under ``no_grad`` PyTorch gathers the
first unit once more than usual in the next step's backward.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from shard_runtime import fully_shard
from shard_testing import Batch, RankPool, make_batches

pytest.importorskip("torchao")

from torchao.float8 import (
    Float8LinearConfig,
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
)
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import (
    NF4Tensor,
    linear_nf4,
    to_nf4,
)

_WORLD = 2
_STEPS = 3
_BATCH = 4
_LORA_RANK = 8
# NF4 quantizes blocks of 64 values and its scalers in blocks of 256, so a
# shard needs 64 * 256 elements: 256 x 128 over 2 ranks is one such block each.
_QLORA_DIMS = ((128, 256), (256, 128))
_FLOAT8_DIM = 64
_FLOAT8_BATCH = 16

ShardWith = Callable[..., Any]


# - counting


@contextlib.contextmanager
def _counting_hooks(cls: type) -> Iterator[dict[str, int]]:
    """Count calls of ``cls``'s two all-gather hooks while the block runs."""
    counts = {"pre": 0, "post": 0}
    originals = {"pre": cls.fsdp_pre_all_gather, "post": cls.fsdp_post_all_gather}  # type: ignore[attr-defined]

    def counted(which: str) -> Callable[..., Any]:
        original = originals[which]

        @functools.wraps(original)  # keeps the signature PyTorch inspects
        def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
            counts[which] += 1
            return original(self, *args, **kwargs)

        return hook

    cls.fsdp_pre_all_gather = counted("pre")  # type: ignore[attr-defined]
    cls.fsdp_post_all_gather = counted("post")  # type: ignore[attr-defined]
    try:
        yield counts
    finally:
        cls.fsdp_pre_all_gather = originals["pre"]  # type: ignore[attr-defined]
        cls.fsdp_post_all_gather = originals["post"]  # type: ignore[attr-defined]


@contextlib.contextmanager
def _counting_all_gathers() -> Iterator[dict[str, int]]:
    """Bytes of every all-gather output by dtype while the block runs.

    See [Note: counting the same way for both].
    """
    gathered: dict[str, int] = {}

    def add(tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            key = str(tensor.dtype).removeprefix("torch.")
            gathered[key] = gathered.get(key, 0) + tensor.numel() * tensor.element_size()

    singles = ("all_gather_single", "all_gather_into_tensor")
    originals = {name: getattr(dist, name) for name in (*singles, "all_gather")}

    def single(name: str) -> Callable[..., Any]:
        def gather(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            add([output])
            return originals[name](output, *args, **kwargs)

        return gather

    def listed(outputs: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        add(outputs)
        return originals["all_gather"](outputs, *args, **kwargs)

    for name in singles:
        setattr(dist, name, single(name))
    dist.all_gather = listed  # type: ignore[assignment]
    try:
        yield gathered
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _full(param: nn.Parameter) -> list[Any]:
    """A sharded parameter's full values."""
    assert isinstance(param, DTensor), type(param)
    return param.full_tensor().tolist()


def _warm_up(model: nn.Module, x: torch.Tensor) -> None:
    """One forward and backward whose gradients are dropped.

    See [Note: counting the same way for both].
    """
    model(x).sum().backward()
    model.zero_grad(set_to_none=True)


def _step_record(gathered: dict[str, int], hooks: dict[str, int]) -> dict[str, Any]:
    """What one step sent and called: all-gathered bytes in any dtype, and hook calls."""
    return {"all_gathered_bytes": sum(gathered.values()), "hooks": dict(hooks)}


# - NF4 QLoRA


class _QLoRALinear(nn.Module):
    """A frozen NF4 base weight plus a trainable low-rank update, as torchtune builds QLoRA."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        base = torch.randn(out_dim, in_dim) / math.sqrt(in_dim)
        self.weight = nn.Parameter(to_nf4(base), requires_grad=False)
        self.lora_a = nn.Linear(in_dim, _LORA_RANK, bias=False)
        self.lora_b = nn.Linear(_LORA_RANK, out_dim, bias=False)
        # (type name, shape) of the weight each forward computed with
        self.seen: list[tuple[str, tuple[int, ...]]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((type(self.weight).__name__, tuple(self.weight.shape)))
        return linear_nf4(x, self.weight) + self.lora_b(self.lora_a(x))


def _qlora_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(_QLoRALinear(i, o) for i, o in _QLORA_DIMS))


def _qlora_full_state_dict() -> dict[str, torch.Tensor]:
    """The eager model's weights before NF4, as a base model's checkpoint ships them."""
    torch.manual_seed(0)
    full: dict[str, torch.Tensor] = {}
    for index, (in_dim, out_dim) in enumerate(_QLORA_DIMS):  # draws as _QLoRALinear does
        full[f"{index}.weight"] = torch.randn(out_dim, in_dim) / math.sqrt(in_dim)
        full[f"{index}.lora_a.weight"] = nn.Linear(in_dim, _LORA_RANK, bias=False).weight.detach()
        full[f"{index}.lora_b.weight"] = nn.Linear(_LORA_RANK, out_dim, bias=False).weight.detach()
    return full


def _nf4_shard(param: object) -> dict[str, Any]:
    """What one rank holds of a sharded NF4 base weight."""
    local = param.to_local() if isinstance(param, DTensor) else param
    fact: dict[str, Any] = {"param": type(param).__name__, "local": type(local).__name__}
    if isinstance(local, NF4Tensor):
        fact["shape"] = tuple(local.shape)
        fact["bytes"] = {
            name: getattr(local, name).numel() * getattr(local, name).element_size()
            for name in ("quantized_data", "quantized_scalers", "quantization_factor")
        }
    return fact


def _load_full_state_dict(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Load a full state dict into a sharded meta-device model as torchtune does for NF4.

    PyTorch's ``set_model_state_dict`` cannot load into NF4 parameters (it
    recurses without end copying into them), so each rank quantizes the full
    weight, keeps its rows and puts them in a DTensor shaped like the sharded
    parameter; every other weight is distributed over the parameter's mesh;
    then ``load_state_dict(assign=True)`` swaps them in.
    """
    sharded: dict[str, nn.Parameter] = {}
    for name, meta_param in model.state_dict().items():
        assert isinstance(meta_param, DTensor), name
        mesh, placements = meta_param.device_mesh, meta_param.placements
        tensor = full[name]
        if isinstance(meta_param.to_local(), NF4Tensor):
            rows = to_nf4(tensor).chunk(mesh.size(), dim=0)[mesh.get_local_rank()]
            value = DTensor.from_local(
                rows, mesh, placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
            )
        else:
            value = distribute_tensor(tensor, mesh, placements)
        sharded[name] = nn.Parameter(value, requires_grad=meta_param.requires_grad)
    model.load_state_dict(sharded, assign=True)


def _train_qlora(shard_with: ShardWith, meta: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (_WORLD,))
    if meta:
        with torch.device("meta"):
            model = _qlora_model()
    else:
        model = _qlora_model()
    for layer in model:
        shard_with(layer, mesh=mesh)
    shard_with(model, mesh=mesh)
    result: dict[str, Any] = {}
    if meta:
        _load_full_state_dict(model, _qlora_full_state_dict())
        result["loaded"] = [_nf4_shard(layer.weight) for layer in model]
    g = torch.Generator().manual_seed(dist.get_rank())
    _warm_up(model, torch.randn(_BATCH, _QLORA_DIMS[0][0], generator=g))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    losses: list[float] = []
    steps: list[dict[str, Any]] = []
    for _ in range(_STEPS):
        x = torch.randn(_BATCH, _QLORA_DIMS[0][0], generator=g)
        y = torch.randn(_BATCH, _QLORA_DIMS[-1][1], generator=g)
        with _counting_hooks(NF4Tensor) as hooks, _counting_all_gathers() as gathered:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
        steps.append(_step_record(gathered, hooks))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    result.update(
        losses=losses,
        steps=steps,
        lora=[_full(p) for p in trainable],
        shards=[_nf4_shard(layer.weight) for layer in model],
        seen=[layer.seen[1:] for layer in model if isinstance(layer, _QLoRALinear)],  # no warm-up
    )
    return result


def _qlora(meta: bool) -> dict[str, Any]:
    torch_result = _train_qlora(torch_fully_shard, meta)
    shard_result = _train_qlora(fully_shard, meta)
    dist.barrier()
    return {"torch": torch_result, "shard": shard_result}


def _expected_nf4_shard(in_dim: int, out_dim: int) -> dict[str, Any]:
    numel = out_dim * in_dim // _WORLD
    return {
        "param": "DTensor",
        "local": "NF4Tensor",
        "shape": (out_dim // _WORLD, in_dim),
        # 2 values per byte, one int8 scaler per 64 values, one fp32 factor per 256 scalers
        "bytes": {
            "quantized_data": numel // 2,
            "quantized_scalers": numel // 64,
            "quantization_factor": numel // 64 // 256 * 4,
        },
    }


def _check_qlora(result: dict[str, Any]) -> None:
    torch_result, shard_result = result["torch"], result["shard"]
    expected_shards = [_expected_nf4_shard(i, o) for i, o in _QLORA_DIMS]
    assert torch_result["shards"] == expected_shards  # the facts below rest on PyTorch's behaviour
    assert shard_result["shards"] == expected_shards
    full_weights = [[("NF4Tensor", (o, i))] * _STEPS for i, o in _QLORA_DIMS]
    assert torch_result["seen"] == full_weights
    assert shard_result["seen"] == full_weights
    assert shard_result["losses"] == torch_result["losses"]
    assert shard_result["lora"] == torch_result["lora"]
    assert shard_result["steps"] == torch_result["steps"]


def test_qlora_nf4_trains_as_under_pytorch(rank_pool: RankPool) -> None:
    """NF4 weights stay NF4 sharded and gathered; QLoRA trains as under PyTorch, bytes included."""
    for result in rank_pool.run(_qlora, _WORLD, False):
        _check_qlora(result)


def test_qlora_nf4_meta_init_loads_full_state_dict_as_under_pytorch(rank_pool: RankPool) -> None:
    """Built on meta, sharded, then loaded: NF4 weights keep 4 bits a value, train as in PyTorch."""
    for result in rank_pool.run(_qlora, _WORLD, True):
        expected_shards = [_expected_nf4_shard(i, o) for i, o in _QLORA_DIMS]
        assert result["torch"]["loaded"] == expected_shards
        assert result["shard"]["loaded"] == expected_shards
        _check_qlora(result)


# - float8 training with float8 all-gather


def _float8_model(bias: bool) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(_FLOAT8_DIM, _FLOAT8_DIM, bias=bias) for _ in range(2)))
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    return convert_to_float8_training(model, config=config)


def _float8_batch(generator: torch.Generator, rows: int) -> Batch:
    return (
        torch.randn(rows, _FLOAT8_DIM, generator=generator),
        torch.randn(rows, _FLOAT8_DIM, generator=generator),
    )


def _float8_batches() -> list[list[Batch]]:
    """``[step][rank]``; the first step warms up. See [Note: counting the same way for both]."""
    return make_batches(0, _STEPS + 1, _WORLD, _FLOAT8_BATCH, _float8_batch)


def _float8_weight_shard(param: object) -> tuple[str, str, tuple[int, ...]]:
    local = param.to_local() if isinstance(param, DTensor) else param
    assert isinstance(local, torch.Tensor), type(local)
    return type(param).__name__, type(local).__name__, tuple(local.shape)


def _train_float8(shard_with: ShardWith, bias: bool, precompute: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (_WORLD,))
    model = _float8_model(bias)
    for layer in model:
        shard_with(layer, mesh=mesh)
    shard_with(model, mesh=mesh)
    rank = dist.get_rank()
    batches = _float8_batches()
    x, _ = batches[0][rank]
    _warm_up(model, x)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if precompute:
        precompute_float8_dynamic_scale_for_fsdp(model)
    losses: list[float] = []
    steps: list[dict[str, Any]] = []
    wire_dtypes: set[str] = set()
    for step_batches in batches[1:]:
        x, y = step_batches[rank]
        with (
            _counting_hooks(WeightWithDynamicFloat8CastTensor) as hooks,
            _counting_all_gathers() as gathered,
        ):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
        steps.append(_step_record(gathered, hooks))
        wire_dtypes.update(gathered)
        optimizer.step()
        optimizer.zero_grad()
        if precompute:
            precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(float(loss.detach()))
    return {
        "losses": losses,
        "steps": steps,
        "params": {name: _full(p) for name, p in model.named_parameters()},
        "shards": [_float8_weight_shard(layer.weight) for layer in model],
        "wire_dtypes": sorted(wire_dtypes),
    }


def _values(param: nn.Parameter) -> list[Any]:
    """A plain parameter's values; a float8 training weight keeps its fp32 values in ``_tensor``."""
    if isinstance(param, WeightWithDynamicFloat8CastTensor):
        return param._tensor.tolist()  # type: ignore[no-any-return]
    return param.tolist()


def _reference_float8(bias: bool) -> dict[str, Any]:
    """Every rank's losses and the parameters, from one process that runs each rank's batch in turn.

    A global-batch reference would not do: float8 scales each input by its
    own largest value. Each rank's gradient is computed alone and the mean
    taken as a 2-rank reduce-scatter takes it (sum, then halve: exact).
    """
    model = _float8_model(bias)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses: list[list[float]] = []
    for step_batches in _float8_batches()[1:]:
        grads: list[list[torch.Tensor]] = []
        step_losses: list[float] = []
        for x, y in step_batches:
            loss = nn.functional.mse_loss(model(x), y)
            grads.append(list(torch.autograd.grad(loss, list(model.parameters()))))
            step_losses.append(float(loss.detach()))
        for param, *per_rank in zip(model.parameters(), *grads, strict=True):
            param.grad = sum(per_rank[1:], per_rank[0]) / len(per_rank)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_losses)
    return {
        "losses": [list(step) for step in zip(*losses, strict=True)],  # [rank][step]
        "params": {name: _values(p) for name, p in model.named_parameters()},
    }


def _float8(precompute: bool) -> dict[str, Any]:
    torch_result = _train_float8(torch_fully_shard, True, precompute)
    shard_result = _train_float8(fully_shard, True, precompute)
    dist.barrier()
    return {"torch": torch_result, "shard": shard_result}


@pytest.mark.parametrize("precompute", [False, True], ids=["dynamic-scale", "precomputed-scale"])
def test_float8_all_gather_trains_as_under_pytorch(rank_pool: RankPool, precompute: bool) -> None:
    """float8 weights travel as bytes and train as under PyTorch, scales dynamic or precomputed."""
    for result in rank_pool.run(_float8, _WORLD, precompute):
        torch_result, shard_result = result["torch"], result["shard"]
        shards = [
            ("DTensor", "WeightWithDynamicFloat8CastTensor", (_FLOAT8_DIM // _WORLD, _FLOAT8_DIM))
        ] * 2
        assert torch_result["shards"] == shards
        assert shard_result["shards"] == shards
        # Each unit's float8 weight and fp32 bias travel as bytes in one uint8 buffer.
        assert torch_result["wire_dtypes"] == ["uint8"]
        assert shard_result["losses"] == torch_result["losses"]
        assert shard_result["params"] == torch_result["params"]
        assert shard_result["steps"] == torch_result["steps"]


def _float8_weights_only() -> dict[str, Any]:
    return {
        "shard": _train_float8(fully_shard, False, False),
        "reference": _reference_float8(False),
    }


def test_float8_all_gather_of_weights_only_units_trains_on_gloo(rank_pool: RankPool) -> None:
    """Units of float8 weights alone, which PyTorch cannot gather on gloo, train as one process.

    PyTorch gathers such a unit in float8_e4m3fn and gloo raises "Invalid
    scalar type"; a unit that also holds an fp32 bias goes as uint8.
    """
    for rank, result in enumerate(rank_pool.run(_float8_weights_only, _WORLD)):
        shard_result, reference = result["shard"], result["reference"]
        shards = [
            ("DTensor", "WeightWithDynamicFloat8CastTensor", (_FLOAT8_DIM // _WORLD, _FLOAT8_DIM))
        ] * 2
        assert shard_result["shards"] == shards
        assert shard_result["losses"] == reference["losses"][rank]
        assert shard_result["params"] == reference["params"]
        # per step 2 units gathered for forward and again for backward, 1 byte per weight value
        step = {"all_gathered_bytes": 4 * _FLOAT8_DIM * _FLOAT8_DIM, "hooks": {"pre": 4, "post": 4}}
        assert shard_result["steps"] == [step] * _STEPS


# - DCP: a checkpoint of subclass weights saves and loads as the subclass


def _dcp_model(kind: str, other: bool, shard_with: ShardWith) -> nn.Sequential:
    """The model to save, or (``other``) one of the same shapes with other weights to load into."""
    model = _qlora_model() if kind == "nf4" else _float8_model(bias=True)
    if other:
        with torch.no_grad():
            for module in model:
                if isinstance(module, _QLoRALinear):
                    base = torch.randn(module.weight.shape)
                    module.weight = nn.Parameter(to_nf4(base), requires_grad=False)
                else:
                    for param in module.parameters():
                        param.mul_(2.0)
    mesh = init_device_mesh("cpu", (_WORLD,))
    for layer in model:
        shard_with(layer, mesh=mesh)
    shard_with(model, mesh=mesh)
    return model


def _dcp_round_trip(kind: str, directory: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    result: dict[str, Any] = {}
    for name, shard_with in (("torch", torch_fully_shard), ("shard", fully_shard)):
        x = torch.randn(_BATCH, _QLORA_DIMS[0][0] if kind == "nf4" else _FLOAT8_DIM)
        saved = _dcp_model(kind, False, shard_with)
        expected = saved(x).detach()
        path = f"{directory}/{name}"
        dcp.save(saved.state_dict(), checkpoint_id=path)
        loaded = _dcp_model(kind, True, shard_with)
        before = loaded(x).detach()
        state = loaded.state_dict()
        dcp.load(state, checkpoint_id=path)
        loaded.load_state_dict(state)
        local = loaded[0].weight.to_local()
        result[name] = {
            "changed_before_load": not torch.equal(before, expected),
            "equal_after_load": torch.equal(loaded(x).detach(), expected),
            "local": type(local).__name__,
        }
    dist.barrier()
    return result


@pytest.mark.parametrize("kind", ["nf4", "float8"])
def test_dcp_round_trip_keeps_the_subclass_as_under_pytorch(
    rank_pool: RankPool, kind: str, tmp_path: Any
) -> None:
    """Save a sharded NF4 / float8 model with DCP, load it into another: same outputs, same type."""
    for result in rank_pool.run(_dcp_round_trip, _WORLD, kind, str(tmp_path)):
        local = "NF4Tensor" if kind == "nf4" else "WeightWithDynamicFloat8CastTensor"
        expected = {"changed_before_load": True, "equal_after_load": True, "local": local}
        assert result == {"torch": expected, "shard": expected}


# - set_model_state_dict with a full state dict loads into subclass weights


def _full_state_dict_load(kind: str) -> dict[str, Any]:
    from shard_checkpoint import StateDictOptions, get_model_state_dict, set_model_state_dict

    full = StateDictOptions(full_state_dict=True)
    x = torch.randn(_BATCH, _QLORA_DIMS[0][0] if kind == "nf4" else _FLOAT8_DIM)
    source = _dcp_model(kind, False, fully_shard)
    target = _dcp_model(kind, True, fully_shard)
    before = torch.equal(target(x), source(x))
    set_model_state_dict(target, get_model_state_dict(source, options=full), options=full)
    local = target[0].weight.to_local()
    return {
        "equal_before": before,
        "equal_after": torch.equal(target(x), source(x)),
        "local": type(local).__name__,
    }


@pytest.mark.parametrize("kind", ["nf4", "float8"])
def test_full_state_dict_loads_into_subclass_weights(rank_pool: RankPool, kind: str) -> None:
    """Beyond PyTorch for NF4 (its set_model_state_dict recurses without end on NF4 weights)."""
    local = "NF4Tensor" if kind == "nf4" else "WeightWithDynamicFloat8CastTensor"
    for result in rank_pool.run(_full_state_dict_load, _WORLD, kind):
        assert result == {"equal_before": False, "equal_after": True, "local": local}
