"""summon_full_params side by side with PyTorch's FSDP1 (CPU, gloo), as its tests pin it.

PyTorch's test_fsdp_unshard_params and test_fsdp_summon_full_params check
what each option shows: the parameters' names (no wrapper segments), types
(``nn.Parameter``), shapes, dtypes (full precision under mixed precision),
devices and values inside the block; ``recurse``, an inner wrapper, a plain
root module holding wrappers; ``rank0_only`` (rank 0 full, the others their
shards); ``with_grads`` (full gradients, ``None`` when no rank has one);
``writeback`` both ways; and the errors for invalid calls (PyTorch's type,
shard's message with PyTorch's words and the fix). One rank function runs
both ``use_orig_params`` modes with bf16 mixed precision per library.

``offload_to_cpu=True`` fails in PyTorch on a CPU-only host (the same bug as
its offloaded state dicts; in the compatibility table), so only shard runs
it, compared with PyTorch's values without offload. Before the first forward
PyTorch decides the root lazily and summoning an inner wrapper first breaks
the later root (in the compatibility table): every block here runs after one
forward.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shard_testing import RankPool
from shard_testing.compat import Impl, fsdp_namespace


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 5)
        self.out = nn.Linear(5, 6)
        self.register_buffer("shift", torch.arange(6.0) / 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shift: torch.Tensor = self.shift
        return x + self.out(torch.relu(self.fc(x))) + shift


class Net(nn.Module):
    """A root unit (``embed``, ``head``) around two block units."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 6)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(self.embed(x)))
        return out


def _wrap(impl: Impl, orig: bool, **extra: Any) -> nn.Module:
    ns = fsdp_namespace(impl)
    wrap = __import__(f"{ns.__name__}.wrap", fromlist=["wrap"])
    torch.manual_seed(0)
    kwargs: dict[str, Any] = {
        "auto_wrap_policy": wrap.ModuleWrapPolicy({Block}),
        "use_orig_params": orig,
        "mixed_precision": ns.MixedPrecision(
            param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16
        ),
        **extra,
    }
    if impl == "torch":
        kwargs["device_id"] = torch.device("cpu")
    model: nn.Module = ns.FullyShardedDataParallel(Net(), **kwargs)
    return model


def _backward(model: nn.Module, step: int = 0) -> None:
    torch.manual_seed(100 + dist.get_rank() + 10 * step)
    model(torch.rand(4, 8)).pow(2).sum().backward()


def _view(model: nn.Module) -> list[Any]:
    return [
        (
            name,
            type(p).__name__,
            tuple(p.shape),
            str(p.dtype),
            p.device.type,
            p.tolist(),
            None if p.grad is None else p.grad.tolist(),
        )
        for name, p in model.named_parameters()
    ]


def _outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return ("ok", fn())
    except Exception as exc:
        return (type(exc).__name__, str(exc))


def _summoned(impl: Impl, orig: bool) -> dict[str, Any]:
    """What each option shows inside the block, and the model after it."""
    warnings.simplefilter("ignore")  # PyTorch's mixed precision and lazy-init warnings
    fsdp = fsdp_namespace(impl).FullyShardedDataParallel
    out: dict[str, Any] = {}
    model = _wrap(impl, orig)
    _backward(model)
    calls: dict[str, tuple[nn.Module, dict[str, Any]]] = {
        "root": (model, {}),
        "root recurse=False": (model, {"recurse": False}),
        "inner": (model.blocks[0], {}),
        "inner recurse=False": (model.blocks[0], {"recurse": False}),
        "rank0_only": (model, {"rank0_only": True, "writeback": False}),
    }
    if orig:
        calls["with_grads"] = (model, {"with_grads": True})
        calls["with_grads recurse=False"] = (model, {"with_grads": True, "recurse": False})
    if impl == "shard":  # PyTorch's offload fails on a CPU-only host
        calls["offload_to_cpu"] = (
            model,
            {"offload_to_cpu": True, "rank0_only": True, "writeback": False},
        )
    for name, (target, kwargs) in calls.items():
        out[name] = _outcome(lambda t=target, k=kwargs: _inside(fsdp, model, t, **k))
    out["after"] = _view(model)
    model.zero_grad(set_to_none=True)
    out["no_grads"] = _outcome(lambda: _inside(fsdp, model, model, with_grads=orig))
    holder = nn.Sequential(nn.Linear(2, 2), _wrap(impl, orig))
    _backward(holder[1])
    out["plain root"] = _outcome(lambda: _inside(fsdp, holder, holder))

    def names() -> list[list[str]]:
        with fsdp.summon_full_params(model):
            return [
                [n for n, _ in model.named_parameters(prefix="top")],
                [n for n, _ in model.named_parameters(recurse=False)],
                [n for n, _ in model.named_buffers(prefix="top")],
                [n for n, _ in model.blocks[1].named_parameters()],
            ]

    out["names"] = _outcome(names)
    for writeback in (True, False):
        for target in ("root", "inner"):
            edited = _wrap(impl, orig)
            _backward(edited)
            summoned = edited if target == "root" else edited.blocks[1]
            with fsdp.summon_full_params(summoned, writeback=writeback), torch.no_grad():
                for p in summoned.parameters():
                    p.fill_(0.25)
                    if p.grad is not None:
                        p.grad.zero_()
            out[f"writeback={writeback} {target}"] = _outcome(
                lambda e=edited: _inside(fsdp, e, e, with_grads=orig)
            )
            out[f"writeback={writeback} {target} trains"] = (_backward(edited, 1), _view(edited))[1]
    return out


def _inside(fsdp: Any, model: nn.Module, target: nn.Module, **kwargs: Any) -> list[Any]:
    with fsdp.summon_full_params(target, **kwargs):
        return _view(model)


def _errors(impl: Impl) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    fsdp = fsdp_namespace(impl).FullyShardedDataParallel
    out: dict[str, Any] = {}
    model = _wrap(impl, orig=False)
    _backward(model)

    def enter(*targets: nn.Module, **kwargs: Any) -> None:
        with fsdp.summon_full_params(targets[0], **kwargs):
            if len(targets) > 1:
                with fsdp.summon_full_params(targets[1]):
                    pass

    out["rank0_only with writeback"] = _outcome(lambda: enter(model, rank0_only=True))
    # What PyTorch has not implemented, and shard does (both refused before any gather there).
    orig = _wrap(impl, orig=True)
    _backward(orig)
    offloaded = {"offload_to_cpu": True, "rank0_only": True, "writeback": False}
    out["with_grads and offload_to_cpu"] = _outcome(
        lambda: enter(orig, with_grads=True, **offloaded)
    )
    ns = fsdp_namespace(impl)
    no_shard = _wrap(impl, orig=False, sharding_strategy=ns.ShardingStrategy.NO_SHARD)
    _backward(no_shard)
    out["offload_to_cpu with NO_SHARD"] = _outcome(lambda: enter(no_shard, **offloaded))
    out["with_grads, flat parameters"] = _outcome(lambda: enter(model, with_grads=True))
    out["again inside"] = _outcome(lambda: enter(model, model))
    out["root inside inner"] = _outcome(lambda: enter(model.blocks[0], model))
    out["inner inside root"] = _outcome(lambda: enter(model, model.blocks[0]))

    class Summons(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(4))

        def forward(self, wrapper: nn.Module) -> torch.Tensor:
            with fsdp.summon_full_params(wrapper):
                pass
            return self.weight.sum()

    kwargs = {"device_id": torch.device("cpu")} if impl == "torch" else {}
    summons = fsdp(Summons(), **kwargs)
    out["in forward"] = _outcome(lambda: summons(summons))
    linear = fsdp(nn.Linear(2, 1), **kwargs)
    output = linear(torch.ones(2))

    def summon_in_backward(grad: torch.Tensor) -> None:
        with fsdp.summon_full_params(linear):
            pass

    output.register_hook(summon_in_backward)
    out["in backward"] = _outcome(lambda: output.sum().backward())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Last: PyTorch then fails to offload on this CPU-only host (on every rank alike).
        out["offload"] = _outcome(lambda: enter(model, offload_to_cpu=True, writeback=False))[0]
    out["offload warns"] = sorted(
        {w.category.__name__ for w in caught if "rank0_only" in str(w.message)}
    )
    return out


def test_summon_full_params_shows_what_pytorch_shows(rank_pool: RankPool) -> None:
    """Inside summon_full_params, on nested wrappers with bf16 mixed precision, both
    use_orig_params modes: the root, recurse=False, an inner wrapper, rank0_only (rank 0 full,
    rank 1 its shards), with_grads (full averaged gradients; none when no rank has any), a plain
    module holding a wrapper, named_parameters/named_buffers with prefix and recurse, and
    writeback both ways on the root and an inner wrapper (the edit kept or dropped, the next
    step alike): names, parameter types, shapes, dtypes, devices, values and gradients are
    PyTorch's. shard's offload_to_cpu=True (with rank0_only) shows PyTorch's rank0_only values."""
    for orig in (False, True):
        theirs = rank_pool.run(_summoned, 2, "torch", orig)
        ours = rank_pool.run(_summoned, 2, "shard", orig)
        for rank, (their, our) in enumerate(zip(theirs, ours, strict=True)):
            assert our.pop("offload_to_cpu") == their["rank0_only"]
            assert our == their
            root = their["root"][1]
            assert {entry[1:5] for entry in root} >= {("Parameter", (6, 8), "torch.float32", "cpu")}
            assert their["names"][1][0] == ["top.embed.weight", "top.embed.bias"] + [
                f"top.blocks.{b}.{m}.{p}"
                for b in (0, 1)
                for m in ("fc", "out")
                for p in ("weight", "bias")
            ] + ["top.head.weight", "top.head.bias"]
            if orig:
                assert all(entry[6] is not None for entry in their["with_grads"][1])
                assert all(entry[6] is None for entry in their["no_grads"][1])
            if rank == 1:
                assert their["rank0_only"][1] != root


def test_summon_full_params_errors_carry_pytorchs_words(rank_pool: RankPool) -> None:
    """Invalid calls raise PyTorch's exception types, shard's messages naming the fix and
    carrying the words PyTorch's tests match ("is not supported", "Cannot manually unshard
    parameters during forward/backward"); entering it again inside is an AssertionError. Both
    warn that offload_to_cpu without rank0_only copies the model to every rank. shard runs
    with_grads with offload_to_cpu and offload_to_cpu with NO_SHARD, which PyTorch refuses as
    not implemented yet (a deliberate difference)."""
    theirs = rank_pool.run(_errors, 2, "torch")[0]
    ours = rank_pool.run(_errors, 2, "shard")[0]
    extensions = ("with_grads and offload_to_cpu", "offload_to_cpu with NO_SHARD")
    for key, outcome in theirs.items():
        if not key.startswith("offload") and key not in extensions:
            assert (key, ours[key][0]) == (key, outcome[0])
    for key in extensions:  # deliberate: shard does what PyTorch has not implemented
        assert theirs[key][0] == "NotImplementedError"
        assert theirs[key][1].endswith("is not supported yet")
        assert ours[key] == ("ok", None)
    assert theirs["rank0_only with writeback"][1] == (
        "writeback=True and rank0_only=True is not supported yet"
    )
    assert ours["rank0_only with writeback"][1] == (
        "summon_full_params: writeback=True and rank0_only=True is not supported: the other "
        "ranks see no full parameters to write back; pass writeback=False"
    )
    assert "is not supported" in ours["with_grads, flat parameters"][1]
    for key in ("in forward", "in backward"):
        assert theirs[key] == (
            "AssertionError",
            "Cannot manually unshard parameters during forward/backward",
        )
        assert "Cannot manually unshard parameters during forward/backward" in ours[key][1]
        assert "call it between steps" in ours[key][1]
    assert ours["again inside"][1].startswith(
        "summon_full_params: the wrapper around Net is already inside summon_full_params"
    )
    assert theirs["offload warns"] == ours["offload warns"] == ["UserWarning"]
    assert (theirs["offload"], ours["offload"]) == ("RuntimeError", "ok")
