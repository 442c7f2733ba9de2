"""``FullyShardedDataParallel`` side by side with PyTorch's (FSDP1).

Each rank function takes ``impl`` ("torch" or "shard"), imports the wrapper
from that library, runs the same user code and returns plain values (names,
shapes, values as lists, exception type names); the tests assert that both
libraries return the same, and spot-check PyTorch's answers so that a
comparison cannot pass vacuously. PyTorch's wrapper runs on the CPU with
``device_id=torch.device("cpu")``.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn

import shard_runtime
from shard_testing import RankPool
from shard_testing.compat import error_type as _error


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 6)
        self.down = nn.Linear(6, 4)
        self.register_buffer("scale", torch.full((4,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x))) * self.scale


class Net(nn.Module):
    """A root unit of 26 parameters (inp, out) over two block units of 58 each."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(3, 4)
        self.blocks = nn.Sequential(Block(), Block())
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


def _api(impl: str) -> tuple[Any, Any, dict[str, Any]]:
    """(wrapper class, the library's namespace, the wrapper's extra keyword arguments)."""
    if impl == "torch":
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        kwargs = {"device_id": torch.device("cpu"), "auto_wrap_policy": ModuleWrapPolicy({Block})}
        return torch_fsdp.FullyShardedDataParallel, torch_fsdp, kwargs
    kwargs = {"auto_wrap_policy": shard_runtime.ModuleWrapPolicy({Block})}
    return shard_runtime.FullyShardedDataParallel, shard_runtime, kwargs


def _params(model: nn.Module, values: bool = True) -> list[Any]:
    return [
        (n, tuple(p.shape), type(p).__name__, p.requires_grad, p.tolist() if values else None)
        for n, p in model.named_parameters()
    ]


def _listed(t: torch.Tensor | None, *, flat: bool = False) -> list[Any] | None:
    if t is None:
        return None
    listed: list[Any] = (t.reshape(-1) if flat else t).tolist()
    return listed


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)


# ---------------------------------------------------------------------- summon_full_params


def _summon(impl: str, use_orig_params: bool) -> dict[str, Any]:
    wrapper, _, kwargs = _api(impl)
    model = wrapper(Net(), use_orig_params=use_orig_params, **kwargs)
    x = torch.arange(6.0).reshape(2, 3)
    out: dict[str, Any] = {
        "root_before_forward": model.check_is_root(),
        "outside": _params(model),
        "outside_buffers": [n for n, _ in model.named_buffers()],
        "outside_inner": _params(model.blocks[0], values=False),
    }
    with wrapper.summon_full_params(model):
        out["inside"] = _params(model)
        out["inside_buffers"] = [(n, b.tolist()) for n, b in model.named_buffers()]
        out["inside_state_dict"] = {k: v.tolist() for k, v in model.state_dict().items()}
        out["inside_inner"] = _params(model.blocks[0])
        out["inside_inner_module"] = [n for n, _ in model.blocks[0].module.named_parameters()]
        out["attribute_is_listed"] = (
            model.inp.weight is dict(model.named_parameters())["inp.weight"]
        )
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("weight"):
                    param.mul_(2.0)
            model.blocks[1].up.bias.add_(1.0)  # reached by attribute
    # Discarded before any forward: after a forward PyTorch keeps the root unit unsharded
    # and its summon then edits that live buffer, so writeback=False keeps the root's edits
    # until the next reshard (shard always discards them).
    with wrapper.summon_full_params(model, writeback=False), torch.no_grad():
        for _, param in model.named_parameters():
            param.zero_()
    with torch.no_grad():
        out["after_edits"] = model(x).tolist()
    with wrapper.summon_full_params(model, recurse=False, writeback=False):
        out["recurse_false"] = _params(model)
    with wrapper.summon_full_params(model.blocks[0], writeback=False):
        out["inner_summoned_root"] = _params(model, values=False)
        out["inner_summoned_inner"] = _params(model.blocks[0])
    with wrapper.summon_full_params(model, writeback=False):
        out["nested"] = [
            _error(lambda: wrapper.summon_full_params(model).__enter__()),
            _error(lambda: wrapper.summon_full_params(model.blocks[1]).__enter__()),
        ]
    with wrapper.summon_full_params(model, rank0_only=True, writeback=False):
        out["rank0_only"] = _params(model)
    # PyTorch's offload_to_cpu fails on a CPU-only machine (the handle frees the CPU
    # storage it gathered into), so shard's offloaded view is compared with PyTorch's plain one.
    offload = impl == "shard"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "summon_full_params: offload_to_cpu=True without")
        with wrapper.summon_full_params(model, offload_to_cpu=offload, writeback=False):
            out["offload_to_cpu"] = _params(model)
    out["root_after_forward"] = model.check_is_root()
    out["inner_after_forward"] = model.blocks[0].check_is_root()
    out["rank0_only_writeback"] = _error(
        lambda: wrapper.summon_full_params(model, rank0_only=True).__enter__()
    )
    rank = dist.get_rank()
    inputs, target = _batch(rank)
    nn.functional.mse_loss(model(inputs), target).backward()
    if use_orig_params:
        with wrapper.summon_full_params(model, with_grads=True, writeback=False):
            out["with_grads"] = [(n, p.grad.tolist()) for n, p in model.named_parameters()]
    else:
        out["with_grads"] = _error(
            lambda: wrapper.summon_full_params(model, with_grads=True).__enter__()
        )
    out["outside_after"] = [n for n, _ in model.named_parameters()]
    # Last: PyTorch's offload_to_cpu fails on CPU after warning (see above).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with wrapper.summon_full_params(model, offload_to_cpu=True, writeback=False):
                pass
        except RuntimeError:
            assert impl == "torch"
    # PyTorch warns once or twice per unit; the kind is what users filter on.
    out["offload_warning"] = sorted(
        {w.category.__name__ for w in caught if "offload" in str(w.message)}
    )
    return out


@pytest.fixture(scope="module", params=[(2, False), (2, True), (3, False), (3, True)])
def summoned(request: pytest.FixtureRequest, rank_pool: RankPool) -> dict[str, Any]:
    world, orig = request.param
    return {
        "world": world,
        "orig": orig,
        "torch": rank_pool.run(_summon, world, "torch", orig),
        "shard": rank_pool.run(_summon, world, "shard", orig),
    }


SUMMON_KEYS = [
    "outside",
    "outside_buffers",
    "outside_inner",
    "inside",
    "inside_buffers",
    "inside_state_dict",
    "inside_inner",
    "inside_inner_module",
    "attribute_is_listed",
    "after_edits",
    "recurse_false",
    "inner_summoned_root",
    "inner_summoned_inner",
    "rank0_only",
    "offload_to_cpu",
    "root_before_forward",
    "root_after_forward",
    "inner_after_forward",
    "rank0_only_writeback",
    "with_grads",
    "outside_after",
    "nested",
    "offload_warning",
]


@pytest.mark.parametrize("key", SUMMON_KEYS)
def test_summon_full_params_matches_pytorch(summoned: dict[str, Any], key: str) -> None:
    """Names, shapes, types, values and write-back effects in and around summon_full_params
    equal PyTorch's on every rank (2 ranks, and 3 for uneven shards; both parameter modes)."""
    for rank, (theirs, ours) in enumerate(zip(summoned["torch"], summoned["shard"], strict=True)):
        assert ours[key] == theirs[key], f"rank {rank}"


def test_pytorch_answers_are_the_documented_ones(summoned: dict[str, Any]) -> None:
    """Spot checks of PyTorch's side: original names inside, wrapper segments outside."""
    rank0 = summoned["torch"][0]
    inside = [name for name, *_ in rank0["inside"]]
    assert inside[:2] == ["inp.weight", "inp.bias"]
    assert "blocks.1.down.weight" in inside
    assert {shape for name, shape, *_ in rank0["inside"] if name == "blocks.0.up.weight"} == {
        (6, 4)
    }
    assert all(kind == "Parameter" for _, _, kind, _, _ in rank0["inside"])
    assert rank0["attribute_is_listed"] is True
    assert all(n.startswith("_fsdp_wrapped_module.") for n in rank0["outside_after"])
    assert [n for n, _ in rank0["inside_buffers"]] == ["blocks.0.scale", "blocks.1.scale"]
    assert rank0["root_after_forward"] is True
    assert rank0["inner_after_forward"] is False
    assert rank0["rank0_only_writeback"] == "NotImplementedError"
    assert rank0["nested"] == ["AssertionError", "AssertionError"]
    assert rank0["offload_warning"] == ["UserWarning"]
    if summoned["orig"]:
        assert rank0["outside"][0][0] == "_fsdp_wrapped_module.inp.weight"
    else:
        assert rank0["outside"][0][0] == "_fsdp_wrapped_module._flat_param"
        assert [n for n, *_ in rank0["recurse_false"]] == [
            "inp.weight",
            "inp.bias",
            "blocks.0._flat_param",
            "blocks.1._flat_param",
            "out.weight",
            "out.bias",
        ]
        assert rank0["with_grads"] == "NotImplementedError"
    # Rank 1 sees the sharded view under rank0_only (no full shapes).
    rank1_shapes = [shape for _, shape, *_ in summoned["torch"][1]["rank0_only"]]
    assert all(len(shape) == 1 for shape in rank1_shapes)


def test_inner_wrapper_is_not_root_before_the_first_forward(rank_pool: RankPool) -> None:
    """shard decides the root when wrapping: an inner wrapper answers False even before the
    first forward (PyTorch's lazy decision would make the first wrapper asked a root)."""

    assert rank_pool.run(_inner_root_before_forward, 2) == [[True, False], [True, False]]


def _inner_root_before_forward() -> list[bool]:
    model = shard_runtime.FullyShardedDataParallel(
        Net(), auto_wrap_policy=shard_runtime.ModuleWrapPolicy({Block})
    )
    return [model.check_is_root(), model.blocks[0].check_is_root()]


# ---------------------------------------------------------------------- PyTorch's comm hooks


def _decompress_without_streams(state: Any, grad: torch.Tensor) -> None:
    """PyTorch's ``_decompress`` less ``record_stream``, which fails on CPU tensors."""
    grad.data = grad.data.to(state.parameter_type)


def _hooks(impl: str, hook_name: str, strategy: str, orig: bool) -> dict[str, Any]:
    from torch.distributed.algorithms._comm_hooks import default_hooks

    wrapper, lib, kwargs = _api(impl)
    rank = dist.get_rank()
    # Both libraries call PyTorch's hook; its CPU-only flaw is patched the same for both.
    default_hooks._decompress = _decompress_without_streams  # type: ignore[attr-defined]
    hook = getattr(default_hooks, hook_name)
    state_cls = (
        default_hooks.LowPrecisionState if "compress" in hook_name else default_hooks.DefaultState
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The `NO_SHARD` sharding strategy is deprecated")
        strategy_enum = getattr(lib.ShardingStrategy, strategy)
        model = wrapper(Net(), sharding_strategy=strategy_enum, use_orig_params=orig, **kwargs)
    model.register_comm_hook(state_cls(dist.group.WORLD), hook)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(3):
        inputs, target = _batch(rank + 2 * step)
        loss = nn.functional.mse_loss(model(inputs), target)
        loss.backward()
        losses.append(loss.item())
        # Flattened: the values are compared here; test_unsplit_original_params_keep_their_shapes
        # compares the shapes under NO_SHARD.
        grads.append([(n, _listed(p.grad, flat=True)) for n, p in model.named_parameters()])
        optim.step()
        optim.zero_grad()
    with wrapper.summon_full_params(model, writeback=False):
        params = [(n, p.tolist()) for n, p in model.named_parameters()]
    return {
        "losses": losses,
        "grads": grads,
        "params": params,
        "twice": _error(lambda: model.register_comm_hook(state_cls(dist.group.WORLD), hook)),
        "on_inner": _error(
            lambda: model.blocks[0].register_comm_hook(state_cls(dist.group.WORLD), hook)
        ),
    }


@pytest.mark.parametrize(
    ("hook", "strategy", "orig"),
    [
        ("bf16_compress_hook", "FULL_SHARD", False),
        ("bf16_compress_hook", "FULL_SHARD", True),
        ("reduce_scatter_hook", "SHARD_GRAD_OP", False),
        ("allreduce_hook", "NO_SHARD", False),
        ("fp16_compress_hook", "NO_SHARD", True),
    ],
)
def test_pytorch_comm_hooks_train_identically(
    rank_pool: RankPool, hook: str, strategy: str, orig: bool
) -> None:
    """PyTorch's own hooks with their DefaultState/LowPrecisionState give the same losses,
    gradients and parameters over 3 steps as under PyTorch's wrapper, bit for bit (flat or
    original parameters); registering twice or on an inner wrapper is an AssertionError in both."""
    theirs = rank_pool.run(_hooks, 2, "torch", hook, strategy, orig)
    ours = rank_pool.run(_hooks, 2, "shard", hook, strategy, orig)
    assert ours == theirs
    assert theirs[0]["twice"] == "AssertionError"
    assert theirs[0]["on_inner"] == "AssertionError"
    assert theirs[0]["losses"] != theirs[1]["losses"]  # the ranks saw different data


def _bf16_against_default() -> list[list[Any]]:
    """Gradients of the first step without a hook and with PyTorch's bf16 hook, for shard."""
    from torch.distributed.algorithms._comm_hooks import default_hooks

    default_hooks._decompress = _decompress_without_streams  # type: ignore[attr-defined]
    out = []
    for hook in (None, default_hooks.bf16_compress_hook):
        model = shard_runtime.FullyShardedDataParallel(
            Net(), auto_wrap_policy=shard_runtime.ModuleWrapPolicy({Block})
        )
        if hook is not None:
            model.register_comm_hook(default_hooks.LowPrecisionState(dist.group.WORLD), hook)
        inputs, target = _batch(dist.get_rank())
        nn.functional.mse_loss(model(inputs), target).backward()
        out.append([p.grad.tolist() for p in model.parameters()])
    return out


def test_bf16_hook_really_reduces_in_bf16(rank_pool: RankPool) -> None:
    """The bf16 hook's gradients are close to, and not equal to, the default reduction's."""
    for default, bf16 in rank_pool.run(_bf16_against_default, 2):
        for a, b in zip(default, bf16, strict=True):
            torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=2e-2, atol=2e-2)
        assert default != bf16


def _hook_refusals() -> list[str]:
    from torch.distributed.algorithms._comm_hooks import default_hooks

    policy = shard_runtime.ModuleWrapPolicy({Block})
    wrapper = shard_runtime.FullyShardedDataParallel
    hybrid = wrapper(
        Net(),
        auto_wrap_policy=policy,
        sharding_strategy=shard_runtime.ShardingStrategy.HYBRID_SHARD,
    )
    plain = wrapper(Net(), auto_wrap_policy=policy)
    state = default_hooks.DefaultState(dist.group.WORLD)
    return [
        _error(lambda: hybrid.register_comm_hook(state, default_hooks.allreduce_hook)),
        _error(lambda: plain.register_comm_hook(state, 3)),
    ]


def test_pytorch_hooks_are_refused_where_pytorch_refuses_them(rank_pool: RankPool) -> None:
    """A PyTorch hook on a hybrid strategy is an AssertionError, a non-callable one a
    ValueError, as PyTorch's wrapper answers."""
    assert rank_pool.run(_hook_refusals, 2) == [["AssertionError", "ValueError"]] * 2


# ---------------------------------------------------------------------- unsplit original params


def _unsplit(impl: str, strategy: str) -> dict[str, Any]:
    """use_orig_params=True on a shard axis of one rank: shapes, training, optimizer state."""
    wrapper, lib, kwargs = _api(impl)
    rank = dist.get_rank()

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        with warnings.catch_warnings():
            # PyTorch: NO_SHARD is deprecated; one rank switches to NO_SHARD.
            warnings.filterwarnings("ignore", ".*`NO_SHARD`")
            sharding = getattr(lib.ShardingStrategy, strategy)
            model = wrapper(Net(), sharding_strategy=sharding, use_orig_params=True, **kwargs)
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    def step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> float:
        inputs, target = _batch(rank + 2 * seed)
        loss = nn.functional.mse_loss(model(inputs), target)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss.item()

    model, optim = build()
    out: dict[str, Any] = {"params": _params(model)}
    inputs, target = _batch(rank)
    nn.functional.mse_loss(model(inputs), target).backward()
    out["grads"] = [(n, tuple(p.grad.shape), p.grad.tolist()) for n, p in model.named_parameters()]
    with wrapper.summon_full_params(model, with_grads=True, writeback=False):
        out["summoned_grads"] = [(n, tuple(p.grad.shape)) for n, p in model.named_parameters()]
    out["grads_after_summon"] = [tuple(p.grad.shape) for p in model.parameters()]
    out["clip_norm"] = model.clip_grad_norm_(0.5).item()
    optim.step()
    optim.zero_grad()
    out["losses"] = [step(model, optim, seed) for seed in (1, 2)]
    out["optim_state"] = [
        (n, {k: (tuple(v.shape), v.tolist()) for k, v in optim.state[p].items()})
        for n, p in model.named_parameters()
    ]
    with warnings.catch_warnings():
        # PyTorch's notice that NO_SHARD gives full state dicts.
        warnings.filterwarnings("ignore", "When using ``NO_SHARD``")
        osd = wrapper.optim_state_dict(model, optim)
        state_dict = model.state_dict()
    out["osd"] = {
        fqn: {k: (tuple(v.shape), v.tolist()) for k, v in state.items()}
        for fqn, state in osd["state"].items()
    }
    fresh, fresh_optim = build()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "When using ``NO_SHARD``")
        fresh.load_state_dict(state_dict)
    fresh_optim.load_state_dict(wrapper.optim_state_dict_to_load(fresh, fresh_optim, osd))
    out["next_loss"] = [step(model, optim, 3), step(fresh, fresh_optim, 3)]
    return out


@pytest.mark.parametrize(("strategy", "world"), [("NO_SHARD", 2), ("FULL_SHARD", 1)])
def test_unsplit_original_params_keep_their_shapes(
    rank_pool: RankPool, strategy: str, world: int
) -> None:
    """With use_orig_params=True and a shard axis of one rank (NO_SHARD, or one rank),
    parameters, gradients (also in summon_full_params(with_grads=True)) and optimizer state keep
    their full shapes and values as PyTorch's; clip_grad_norm_ and losses match bit for bit; the
    full optimizer state dict round-trips into a fresh model and optimizer."""
    theirs = rank_pool.run(_unsplit, world, "torch", strategy)
    ours = rank_pool.run(_unsplit, world, "shard", strategy)
    assert ours == theirs
    shapes = {name: shape for name, shape, *_ in theirs[0]["params"]}
    assert shapes["_fsdp_wrapped_module.inp.weight"] == (4, 3)
    for out in ours:
        assert out["next_loss"][0] == out["next_loss"][1]


def _mixed_use_orig_params(impl: str) -> str:
    """An inner wrapper with use_orig_params=True under an outer one with False, then forward."""
    wrapper, _, kwargs = _api(impl)
    kwargs.pop("auto_wrap_policy")
    try:
        net = Net()
        net.blocks[0] = wrapper(net.blocks[0], use_orig_params=True, **kwargs)
        model = wrapper(net, use_orig_params=False, **kwargs)
        model(torch.zeros(2, 3))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_mixed_use_orig_params_is_a_value_error(rank_pool: RankPool) -> None:
    """Nested wrappers with different use_orig_params fail with PyTorch's ValueError (PyTorch at
    the first forward, shard already when the outer wrapper is built); ours names both modules
    and the fix."""
    theirs = rank_pool.run(_mixed_use_orig_params, 2, "torch")[0]
    ours = rank_pool.run(_mixed_use_orig_params, 2, "shard")[0]
    assert theirs.split(":")[0] == ours.split(":")[0] == "ValueError"
    for words in ("Net", "Block", "'blocks.0'", "use_orig_params=True", "pass the same"):
        assert words in ours


# ---------------------------------------------------------------------- state-dict configs

CONFIGS = [
    "StateDictConfig",
    "FullStateDictConfig",
    "ShardedStateDictConfig",
    "LocalStateDictConfig",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "LocalOptimStateDictConfig",
]


def _config_facts(cls: type) -> dict[str, Any]:
    config = cls()
    fields = [(f.name, f.default) for f in dataclasses.fields(cls)]
    for name, default in fields:
        setattr(config, name, not default)
    return {
        "fields": fields,
        "frozen": cls.__dataclass_params__.frozen,  # type: ignore[attr-defined]
        "after_assignment": [getattr(config, name) for name, _ in fields],
        "repr": repr(config).split("(", 1)[1],
        "equal": cls() == cls(),
        "bases": [base.__name__ for base in cls.__mro__],
    }


@pytest.mark.parametrize("name", CONFIGS)
def test_state_dict_configs_are_pytorch_dataclasses(name: str) -> None:
    """Same fields, defaults, field order, mutability, repr, equality and class hierarchy."""
    ours = _config_facts(getattr(shard_runtime, name))
    theirs = _config_facts(getattr(torch_fsdp, name))
    assert ours == theirs
    assert theirs["frozen"] is False


def test_state_dict_settings_fields_match() -> None:
    """StateDictSettings has PyTorch's three required fields, in order, and is mutable."""
    ours = shard_runtime.StateDictSettings
    theirs = torch_fsdp.StateDictSettings
    assert [f.name for f in dataclasses.fields(ours)] == [
        f.name for f in dataclasses.fields(theirs)
    ]
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(ours))
    assert ours.__dataclass_params__.frozen is False  # type: ignore[attr-defined]


def _low_precision_grads(impl: str, use_orig_params: bool, optimizer: str) -> list[Any]:
    fsdp, _, kwargs = _api(impl)
    ns = torch_fsdp if impl == "torch" else shard_runtime
    torch.manual_seed(0)
    model = fsdp(
        nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)),
        mixed_precision=ns.MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, keep_low_precision_grads=True
        ),
        use_orig_params=use_orig_params,
        **kwargs,
    )
    optim_cls = torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW
    optim = optim_cls(model.parameters(), lr=0.1)
    seen: list[Any] = []
    for step in range(2):
        torch.manual_seed(step + dist.get_rank())
        loss = model(torch.randn(4, 5)).float().square().mean()
        loss.backward()  # type: ignore[no-untyped-call]
        seen.append([None if p.grad is None else str(p.grad.dtype) for p in model.parameters()])
        norm = model.clip_grad_norm_(0.05)  # type: ignore[operator]
        seen.append((str(norm.dtype), float(norm).hex()))
        try:
            optim.step()
        except RuntimeError as exc:
            return [*seen, _error(exc)]
        optim.zero_grad()
        seen.append(float(loss.detach()))
    return [*seen, _params(model)]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_keep_low_precision_grads_matches_pytorch(
    rank_pool: RankPool, use_orig_params: bool, optimizer: str
) -> None:
    """keep_low_precision_grads leaves bf16 gradients on fp32 parameters, as PyTorch's wrapper
    does: clip_grad_norm_ returns a bf16 norm, SGD trains to the same values, and AdamW fails in
    its step the same way."""
    ours = rank_pool.run(_low_precision_grads, 2, "shard", use_orig_params, optimizer)
    theirs = rank_pool.run(_low_precision_grads, 2, "torch", use_orig_params, optimizer)
    assert ours == theirs
    assert "torch.bfloat16" in ours[0][0]


def _clipped(impl: str, use_orig_params: bool, seeds: int) -> list[Any]:
    fsdp, _, kwargs = _api(impl)
    model = fsdp(Net(), use_orig_params=use_orig_params, **kwargs)
    seen: list[Any] = []
    for seed in range(seeds):
        torch.manual_seed(seed + dist.get_rank())
        model(torch.randn(8, 3)).square().mean().backward()  # type: ignore[no-untyped-call]
        norm = model.clip_grad_norm_(0.05)
        seen.append(float(norm).hex())
        seen.append([_listed(p.grad) for p in model.parameters()])
        model.zero_grad()
    return seen


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_clip_grad_norm_sums_in_pytorch_order(rank_pool: RankPool, use_orig_params: bool) -> None:
    """The total norm sums the per-parameter norms unit by unit, the outer unit first, as
    PyTorch does: the norm and the clipped gradients are bitwise PyTorch's over 12 seeds."""
    ours = rank_pool.run(_clipped, 2, "shard", use_orig_params, 12)
    theirs = rank_pool.run(_clipped, 2, "torch", use_orig_params, 12)
    assert ours == theirs
