"""The wrapper's init steps: ignored states, meta materialisation, device moves, state sync."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shard_comms import count_collectives
from shard_runtime import fully_shard
from shard_runtime._wrapper_init import (
    materialize_module,
    move_to_device,
    resolve_ignored,
    sync_module_states,
)
from shard_testing import RankPool
from shard_testing.compat import error as _error

CPU = torch.device("cpu")
NO_ACCELERATOR = torch.accelerator.current_accelerator() is None


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(2, 3), nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))


class FullyShardedDataParallel(nn.Module):
    """Stands in for the wrapper class: resolve_ignored recognises it by name."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


class _Scale(nn.Module):
    """A module with a parameter of its own and no reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


# ---------------------------------------------------------------------- resolve_ignored


def test_resolve_ignored_expands_modules_to_subtrees_and_their_parameters() -> None:
    """An ignored module brings its submodules and all their parameters; None gives nothing."""
    model = _model()
    inner = model[1]
    modules, params = resolve_ignored(model, [inner], None)
    assert modules == frozenset({inner, inner[0], inner[1]})
    assert params == frozenset(inner.parameters())
    assert len(params) == 4
    assert resolve_ignored(model, None, None) == (frozenset(), frozenset())
    assert resolve_ignored(model, [], None) == (frozenset(), frozenset())


def test_resolve_ignored_states_takes_parameters_or_modules() -> None:
    """ignored_states takes parameters (no module ignored) or modules, from any iterable."""
    model = _model()
    modules, params = resolve_ignored(model, None, model[0].parameters())
    assert modules == frozenset()
    assert params == frozenset({model[0].weight, model[0].bias})
    modules, params = resolve_ignored(model, None, (m for m in [model[1][1]]))
    assert modules == frozenset({model[1][1]})
    assert params == frozenset({model[1][1].weight, model[1][1].bias})


def test_resolve_ignored_skips_already_sharded_submodules() -> None:
    """A wrapper inside an ignored module is not ignored, nor is anything below it."""
    wrapped = FullyShardedDataParallel(nn.Linear(2, 2))
    holder = nn.Sequential(nn.Linear(2, 2), wrapped)
    model = nn.Sequential(holder, nn.Linear(2, 2))
    modules, params = resolve_ignored(model, [holder], None)
    assert modules == frozenset({holder, holder[0]})
    assert params == frozenset(holder[0].parameters())


def test_resolve_ignored_errors() -> None:
    """Each invalid ignored_modules/ignored_states raises with the culprit and the fix."""
    model = _model()
    wrapped = FullyShardedDataParallel(nn.Linear(2, 2))
    outer = nn.Sequential(nn.Linear(2, 2), wrapped)
    prefix = "FullyShardedDataParallel: "
    cases: dict[str, tuple[Callable[[], object], str]] = {
        "both": (
            lambda: resolve_ignored(model, [model[0]], [model[1]]),
            "ValueError: Cannot pass both ignored_modules and ignored_states at the same time; "
            "pass everything as ignored_states (it takes modules, or parameters)",
        ),
        "mixed": (
            lambda: resolve_ignored(model, None, [model[1][0].weight, model[0]]),
            "ValueError: ignored_states expects all nn.Parameter or all nn.Module entries, but "
            "ignored_states[1] is the module Linear ('0') and ignored_states[0] the parameter "
            "'1.0.weight'; pass only modules, or only parameters (a module's are "
            "module.parameters())",
        ),
        "params_as_modules": (
            lambda: resolve_ignored(model, [model[0], model[0].bias], None),
            "ValueError: ignored_modules expects nn.Module entries, but ignored_modules[1] is "
            "the parameter '0.bias'; pass parameters as ignored_states=[...] instead",
        ),
        "foreign_param": (
            lambda: resolve_ignored(model, [nn.Parameter(torch.ones(2, 5))], None),
            "ValueError: ignored_modules expects nn.Module entries, but ignored_modules[0] is "
            "the parameter of shape (2, 5) (not in Sequential); pass parameters as "
            "ignored_states=[...] instead",
        ),
        "str_in_modules": (
            lambda: resolve_ignored(model, [model[0], "1"], None),  # type: ignore[list-item]
            "ValueError: ignored_modules[1] is a str, not an nn.Module; buffers and plain "
            "tensors are never sharded, so leave them out",
        ),
        "buffer_in_states": (
            lambda: resolve_ignored(model, None, [model[1][1].running_mean]),  # type: ignore[list-item]
            "ValueError: ignored_states[0] is a Tensor, not an nn.Module or an nn.Parameter; "
            "buffers and plain tensors are never sharded, so leave them out",
        ),
        "single_module": (
            lambda: resolve_ignored(model, model[0], None),  # type: ignore[arg-type]
            "TypeError: ignored_modules takes an iterable, got a single Linear; wrap it in a "
            "list: ignored_modules=[...]",
        ),
        "single_param": (
            lambda: resolve_ignored(model, None, model[0].weight),
            "TypeError: ignored_states takes an iterable, got a single Parameter; wrap it in a "
            "list: ignored_states=[...]",
        ),
        "not_iterable": (
            lambda: resolve_ignored(model, 3, None),  # type: ignore[arg-type]
            "TypeError: ignored_modules takes an iterable of modules, got int",
        ),
        "states_not_iterable": (
            lambda: resolve_ignored(model, None, 3),  # type: ignore[arg-type]
            "TypeError: ignored_states takes an iterable of modules or of parameters, got int",
        ),
        "wrapped": (
            lambda: resolve_ignored(outer, [outer[0], wrapped], None),
            "ValueError: ignored_modules should not include FSDP modules: ignored_modules[1] is "
            "FullyShardedDataParallel ('1'), which is already sharded; list the modules it "
            "wraps that should stay whole when wrapping it, or leave it out",
        ),
        "root": (
            lambda: resolve_ignored(model, None, [model]),
            "ValueError: the module being wrapped, Sequential, is itself ignored by "
            "ignored_states, which would leave nothing to shard; do not wrap it, or ignore "
            "only some of its submodules",
        ),
    }
    for name, (fn, message) in cases.items():
        kind, _, text = message.partition(": ")
        assert _error(fn) == f"{kind}: {prefix}{text}", name


def _fully_shard_module_ignored() -> str:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    fully_shard(model[1])
    return _error(lambda: resolve_ignored(model, [model[1]], None))


def test_resolve_ignored_refuses_a_fully_shard_module(rank_pool: RankPool) -> None:
    """A module already sharded by fully_shard cannot be listed as ignored."""
    assert rank_pool.run(_fully_shard_module_ignored, 1) == [
        "ValueError: FullyShardedDataParallel: ignored_modules should not include FSDP "
        "modules: ignored_modules[0] is FSDPLinear ('1'), which is already sharded; list the "
        "modules it wraps that should stay whole when wrapping it, or leave it out"
    ]


# ---------------------------------------------------------------------- materialize_module


def _meta_states(module: nn.Module) -> list[str]:
    named = [*module.named_parameters(), *module.named_buffers()]
    return [name for name, t in named if t.is_meta]


def test_materialize_default_runs_reset_parameters_like_eager_init() -> None:
    """Without param_init_fn, a meta model gets the values eager construction gives it."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    torch.manual_seed(0)
    materialize_module(model, None, CPU, frozenset())
    assert _meta_states(model) == []
    assert list(model.state_dict()) == list(eager.state_dict())
    for name, value in eager.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert [p.requires_grad for p in model.parameters()] == [True] * 6


def test_materialize_default_keeps_tied_parameters_tied() -> None:
    """A parameter shared by two modules stays one parameter, initialised by its first owner."""
    torch.manual_seed(0)
    expected = nn.Embedding(5, 3).weight.detach().clone()
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    torch.manual_seed(0)
    materialize_module(model, None, CPU, frozenset())
    assert model[1].weight is model[0].weight
    assert model[0].weight.device == CPU
    assert torch.equal(model[0].weight.detach(), expected)


def test_materialize_leaves_ignored_and_non_meta_modules_alone() -> None:
    """Only meta modules outside the ignored set are touched; a model off meta is untouched."""
    cpu_linear = nn.Linear(2, 2)
    cpu_weight = cpu_linear.weight.detach().clone()
    with torch.device("meta"):
        model = nn.Sequential(cpu_linear, nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    weight_object = cpu_linear.weight
    materialize_module(model, None, CPU, frozenset({model[2], model[2][0]}))
    assert _meta_states(model) == ["2.0.weight", "2.0.bias"]
    assert model[0].weight is weight_object
    assert torch.equal(model[0].weight.detach(), cpu_weight)
    calls: list[nn.Module] = []
    eager = nn.Linear(2, 2)
    before = eager.weight
    materialize_module(eager, calls.append, CPU, frozenset())
    assert calls == []
    assert eager.weight is before


def test_materialize_with_param_init_fn_calls_meta_modules_breadth_first() -> None:
    """param_init_fn runs root first, breadth-first, on each module still holding meta tensors."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 3)), nn.ReLU())
    calls: list[str] = []

    def init(module: nn.Module) -> None:
        calls.append(type(module).__name__)
        module.to_empty(device=CPU, recurse=False)
        with torch.no_grad():
            for param in module.parameters(recurse=False):
                param.fill_(len(calls))

    materialize_module(model, init, CPU, frozenset())
    assert calls == ["Sequential", "Linear", "Sequential", "Linear"]
    assert _meta_states(model) == []
    assert model[0].weight.detach().tolist() == [[2.0, 2.0], [2.0, 2.0]]
    assert model[1][0].bias.detach().tolist() == [4.0, 4.0, 4.0]


def test_materialize_with_recursive_param_init_fn_calls_it_once() -> None:
    """A param_init_fn that materialises the whole tree at the root is not called again below."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    ignored = nn.Linear(2, 2, device="meta")
    model.append(ignored)
    calls: list[str] = []

    def init(module: nn.Module) -> None:
        calls.append(type(module).__name__)
        for child in list(module.children())[:2]:
            child.to_empty(device=CPU)
            with torch.no_grad():
                for param in child.parameters():
                    param.fill_(7.0)

    materialize_module(model, init, CPU, frozenset({ignored}))
    assert calls == ["Sequential"]
    assert _meta_states(model) == ["2.weight", "2.bias"]
    assert model[1].bias.detach().tolist() == [7.0, 7.0]


def test_materialize_errors() -> None:
    """A non-callable init fn, one that leaves meta, and a module without reset_parameters fail."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), _Scale(), nn.Sequential(_Scale()))
    assert _error(lambda: materialize_module(model, 3, CPU, frozenset())) == (  # type: ignore[arg-type]
        "ValueError: FullyShardedDataParallel: param_init_fn must be a callable taking a module "
        "(it is called on each module left on the meta device), got int"
    )
    assert _error(lambda: materialize_module(model, lambda m: None, CPU, frozenset())) == (
        "ValueError: FullyShardedDataParallel: param_init_fn left '0.weight', '0.bias', "
        "'1.weight' and 3 more on the meta device; it must give each module it is called on "
        "real storage and values, e.g. module.to_empty(device=..., recurse=False) followed by "
        "module.reset_parameters()"
    )
    assert _error(lambda: materialize_module(model, None, CPU, frozenset())) == (
        "ValueError: FullyShardedDataParallel: cannot initialise the meta-device states of "
        "_Scale ('2') (2.scale), _Scale ('3.0') (3.0.scale): no reset_parameters() method; pass "
        "param_init_fn=<a function that initialises one module in place>, or give these "
        "modules a reset_parameters() method"
    )
    assert _meta_states(model) == [
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
        "2.scale",
        "3.0.scale",
    ]


# ---------------------------------------------------------------------- move_to_device


@pytest.mark.skipif(not NO_ACCELERATOR, reason="None means the accelerator where there is one")
def test_move_to_device_on_a_cpu_only_machine() -> None:
    """device_id None or cpu keeps a CPU module where it is; meta tensors are not counted."""
    model = _model()
    weight = model[0].weight
    assert move_to_device(model, None, frozenset()) == CPU
    assert move_to_device(model, torch.device("cpu"), frozenset()) == CPU
    assert move_to_device(model, "cpu", frozenset()) == CPU  # type: ignore[arg-type]
    assert model[0].weight is weight
    model.append(nn.Linear(2, 2, device="meta"))
    assert move_to_device(model, None, frozenset()) == CPU
    assert model[2].weight.is_meta


@pytest.mark.skipif(not NO_ACCELERATOR, reason="checks the messages of a CPU-only machine")
def test_move_to_device_errors_without_accelerator() -> None:
    """An accelerator device_id on a CPU-only machine, or a bad type, fails naming the fix."""
    model = _model()
    assert _error(lambda: move_to_device(model, 0, frozenset())) == (
        "DeviceUnavailableError: FullyShardedDataParallel: device_id=0 is an accelerator "
        "index, but torch sees no accelerator (CUDA or other) on this machine; pass "
        "device_id=None or torch.device('cpu') to run on the CPU"
    )
    assert _error(lambda: move_to_device(model, torch.device("cuda", 1), frozenset())) == (
        "DeviceUnavailableError: FullyShardedDataParallel: device_id=cuda:1 is not available: "
        "torch sees no accelerator on this machine; pass a device that exists, or None to use "
        "the current one"
    )
    assert _error(lambda: move_to_device(model, 1.0, frozenset())) == (  # type: ignore[arg-type]
        "TypeError: FullyShardedDataParallel: device_id must be an int (an accelerator index), "
        "a torch.device or None, got float"
    )
    assert _error(lambda: move_to_device(model, True, frozenset())).startswith(
        "TypeError: FullyShardedDataParallel: device_id must be an int"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_move_to_device_cuda() -> None:
    """An int device_id moves CPU tensors (and grads) in place; ignored ones stay on the CPU."""
    cuda0 = torch.device("cuda", 0)
    model = _model()
    model[0].weight.grad = torch.ones(3, 2)
    weight = model[0].weight
    ignored = model[1][0].bias
    assert move_to_device(model, 0, frozenset({ignored})) == cuda0
    assert model[0].weight is weight
    assert weight.device == cuda0
    assert weight.grad is not None
    assert weight.grad.device == cuda0
    assert model[1][1].running_mean.device == cuda0
    assert ignored.device == CPU
    current = torch.device("cuda", torch.cuda.current_device())
    assert move_to_device(_model(), None, frozenset()) == current
    assert move_to_device(_model(), torch.device("cuda"), frozenset()) == current
    count = torch.cuda.device_count()
    assert _error(lambda: move_to_device(_model(), count, frozenset())) == (
        f"DeviceUnavailableError: FullyShardedDataParallel: device_id=cuda:{count} does not "
        f"exist: this machine has {count} cuda device(s), indices 0 to {count - 1}"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_move_to_device_spread_over_devices() -> None:
    """Tensors on the CPU and a GPU need device_id; a GPU other than device_id is an error."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).cuda())
    assert _error(lambda: move_to_device(model, None, frozenset())) == (
        "LayoutError: FullyShardedDataParallel: the module's parameters and buffers are on "
        "several devices: '0.weight' on cpu, '1.weight' on cuda:0; pass device_id=cuda:0 to "
        "move the CPU ones there, or move the module to one device first"
    )
    assert _error(lambda: move_to_device(model, torch.device("cpu"), frozenset())) == (
        "LayoutError: FullyShardedDataParallel: '1.weight' is on cuda:0 but device_id is cpu; "
        "move it to cpu first, or pass device_id=cuda:0"
    )
    assert move_to_device(model, 0, frozenset()) == torch.device("cuda", 0)
    assert {p.device.type for p in model.parameters()} == {"cuda"}


# ---------------------------------------------------------------------- sync_module_states


class _Flags(nn.Module):
    """A bool buffer, a bf16 parameter and an fp32 parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.rand(5) > 0.5)
        self.low = nn.Parameter(torch.randn(3, 2).to(torch.bfloat16))
        self.high = nn.Parameter(torch.randn(4))


def _synced_model(kind: str) -> nn.Module:
    model: nn.Module
    if kind == "fp32":
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        model(torch.randn(5, 3))  # per-rank running statistics
    elif kind == "mixed":
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2).to(torch.bfloat16), _Flags())
    else:
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2, bias=False))
        model[1].weight = nn.Parameter(model[1].weight.detach().t().contiguous().t())
    return model


def _sync(kind: str, src: int) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = _synced_model(kind)
    ignored = model[0].bias
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with count_collectives() as counts:
        sync_module_states(model, dist.group.WORLD, frozenset({ignored}), src=src)
    after = model.state_dict()
    return {
        "before": before,
        "after": after,
        "ignored_kept": torch.equal(after["0.bias"], before["0.bias"]),
        "broadcasts": counts.calls("broadcast"),
        "bytes": counts.bytes("broadcast"),
        "dtypes": {k: v.dtype for k, v in after.items()},
    }


@pytest.mark.parametrize(
    ("kind", "world_size", "src", "dtypes", "nbytes"),
    [
        # fp32 and the int64 num_batches_tracked of BatchNorm
        ("fp32", 2, 0, 2, (12 + 4 * 4 + 8 + 2) * 4 + 8),
        ("fp32", 3, 1, 2, (12 + 4 * 4 + 8 + 2) * 4 + 8),
        # fp32 (Linear(3, 4).weight, _Flags.high), bf16 (Linear(4, 2), _Flags.low), bool
        ("mixed", 3, 0, 3, (12 + 4) * 4 + (8 + 2 + 6) * 2 + 5),
        # a non-contiguous parameter
        ("strided", 2, 1, 1, (12 + 8) * 4),
    ],
)
def test_sync_module_states_gives_src_values_everywhere(
    rank_pool: RankPool, kind: str, world_size: int, src: int, dtypes: int, nbytes: int
) -> None:
    """Every rank ends with rank src's parameters and buffers, in one broadcast per dtype."""
    results = rank_pool.run(_sync, world_size, kind, src)
    reference = results[src]["before"]
    assert not torch.equal(results[0]["before"]["0.weight"], results[1]["before"]["0.weight"])
    for rank, result in enumerate(results):
        assert result["dtypes"] == {k: v.dtype for k, v in reference.items()}
        for name, value in result["after"].items():
            if name == "0.bias":
                continue
            assert torch.equal(value, reference[name]), (rank, name)
        assert result["ignored_kept"] is True
        assert result["broadcasts"] == dtypes
        assert result["bytes"] == nbytes


def _sync_single_and_errors() -> dict[str, Any]:
    model = nn.Linear(2, 2)
    before = model.weight.detach().clone()
    with count_collectives() as counts:
        sync_module_states(model, dist.group.WORLD, frozenset())
    meta = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    return {
        "unchanged": torch.equal(model.weight.detach(), before),
        "calls": counts.calls(),
        "src": _error(lambda: sync_module_states(model, dist.group.WORLD, frozenset(), src=1)),
        "meta": _error(lambda: sync_module_states(meta, dist.group.WORLD, frozenset())),
    }


def test_sync_module_states_world_of_one_and_errors(rank_pool: RankPool) -> None:
    """One rank communicates nothing; a src outside the group or a meta tensor is an error."""
    (result,) = rank_pool.run(_sync_single_and_errors, 1)
    assert result["unchanged"] is True
    assert result["calls"] == 0
    assert result["src"] == (
        "ValueError: FullyShardedDataParallel: sync_module_states from src=1, but the process "
        "group has 1 rank(s); src is a rank within the group, 0 to 0"
    )
    assert result["meta"] == (
        "ValueError: FullyShardedDataParallel: cannot sync_module_states: '1.weight', "
        "'1.bias' on the meta device; materialise the module first (param_init_fn, or "
        "to_empty and reset_parameters)"
    )


def _sync_skips_sharded_and_ignored() -> dict[str, Any]:
    torch.manual_seed(dist.get_rank())
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3), nn.Linear(3, 2))
    fully_shard(model[1])
    kept = model[2].weight.detach().clone()
    with count_collectives() as counts:
        sync_module_states(model, dist.group.WORLD, frozenset(), ignored_modules={model[2]})
    return {
        "bytes": counts.bytes("broadcast"),
        "weight": model[0].weight.detach().clone(),
        "ignored_kept": torch.equal(model[2].weight.detach(), kept),
    }


def test_sync_module_states_skips_sharded_and_ignored_modules(rank_pool: RankPool) -> None:
    """States of an inner sharded module and of ignored modules are not broadcast."""
    rank0, rank1 = rank_pool.run(_sync_skips_sharded_and_ignored, 2)
    assert rank0["bytes"] == rank1["bytes"] == (6 + 3) * 4
    assert torch.equal(rank0["weight"], rank1["weight"])
    assert rank1["ignored_kept"] is True
