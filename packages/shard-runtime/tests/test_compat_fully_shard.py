"""fully_shard behaves as PyTorch 2.13's: the same script under both, side by side.

Each ``_script_*`` function runs user code against ``impl`` ("torch": PyTorch's
``torch.distributed.fsdp``; "shard": ``shard_runtime``) on every rank and
returns plain values; ``_side_by_side`` runs it for both on the same ranks.
Exceptions are compared by their built-in type (``LayoutError`` is a
``ValueError``, so ``except ValueError`` catches both); our messages are
checked separately for naming the culprit and the fix.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import shard_runtime
from shard_testing import RankPool
from shard_testing.compat import cpu_mesh as _mesh
from shard_testing.compat import fsdp_namespace as _api

IMPLS = ("torch", "shard")


def _builtin_type(exc: BaseException) -> str:
    """The first built-in exception class of ``exc`` (what an ``except`` clause would name)."""
    return next(c.__name__ for c in type(exc).__mro__ if c.__module__ == "builtins")


def _outcome(fn: Callable[[], object]) -> str:
    try:
        fn()
    except Exception as exc:
        return _builtin_type(exc)
    return "ok"


def _message(fn: Callable[[], object]) -> str:
    try:
        fn()
    except Exception as exc:
        return str(exc)
    return ""


def _is_sharded(model: nn.Module) -> list[bool]:
    return [isinstance(p, DTensor) for p in model.parameters()]


def _full(p: torch.Tensor) -> list[float]:
    value = p.full_tensor() if isinstance(p, DTensor) else p
    return [round(v, 5) for v in value.detach().flatten().tolist()]


def _side_by_side(name: str) -> dict[str, Any]:
    script = globals()[name]
    results = {}
    for impl in IMPLS:
        results[impl] = script(impl)
        dist.barrier()
    return results


def _run(rank_pool: RankPool, name: str, world: int = 2) -> list[dict[str, Any]]:
    return rank_pool.run(_side_by_side, world, name)


# ---------------------------------------------------------------------- 1: reshard_after_forward


def _two_units(m: ModuleType, **root_kwargs: Any) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    m.fully_shard(model[0], mesh=_mesh())
    m.fully_shard(model, mesh=_mesh(), **root_kwargs)
    return model


def _script_reshard_after_forward(impl: str) -> dict[str, Any]:
    m = _api(impl)
    out: dict[str, Any] = {}
    x = torch.ones(2, 4)
    for key, kwargs in [
        ("default", {}),
        ("none", {"reshard_after_forward": None}),
        ("true", {"reshard_after_forward": True}),
        ("false", {"reshard_after_forward": False}),
    ]:
        model = _two_units(m, **kwargs)
        y = model(x)
        out[f"{key}_after_forward"] = _is_sharded(model)
        y.sum().backward()
        out[f"{key}_after_backward"] = _is_sharded(model)
        with torch.no_grad():
            model(x)
        out[f"{key}_after_eval"] = _is_sharded(model)
        out[f"{key}_grads"] = [_full(p.grad) for p in model.parameters() if p.grad is not None]
    model = _two_units(m)
    model.set_reshard_after_forward(True, False)  # recurse passed positionally
    model(x)
    out["set_true_root_only"] = _is_sharded(model)
    model = _two_units(m, reshard_after_forward=True)
    model.set_reshard_after_forward(False)
    model(x)
    out["set_false_everywhere"] = _is_sharded(model)
    out["set_int"] = _outcome(lambda: model.set_reshard_after_forward(1))
    return out


def test_reshard_after_forward_none_default_and_explicit_root(rank_pool: RankPool) -> None:
    """None (default) keeps only the root after forward; True reshards the root too, as in torch."""
    for result in _run(rank_pool, "_script_reshard_after_forward"):
        assert result["shard"] == result["torch"]
        shard = result["shard"]
        # parameters: child weight, child bias, root weight, root bias
        assert shard["default_after_forward"] == [True, True, False, False]
        assert shard["default_after_eval"] == [True, True, False, False]
        assert shard["true_after_forward"] == [True, True, True, True]
        assert shard["true_after_eval"] == [True, True, True, True]
        assert shard["default_after_backward"] == [True] * 4
        assert shard["set_true_root_only"] == [True, True, True, True]
        assert shard["set_false_everywhere"] == [False, False, False, False]
        assert shard["set_int"] == "ValueError"


def _script_eval_state_dict_and_train(impl: str) -> dict[str, Any]:
    m = _api(impl)
    out: dict[str, Any] = {}
    model = _two_units(m)
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.ones(2, 4) + dist.get_rank()
    with torch.no_grad():
        model(x)
    out["after_eval"] = _is_sharded(model)
    out["state_dict"] = {
        k: [type(v).__name__, list(v.shape)] for k, v in model.state_dict().items()
    }
    out["after_state_dict"] = _is_sharded(model)
    losses = []
    for _ in range(2):
        loss = model(x).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(round(loss.item(), 5))
        with torch.no_grad():
            losses.append(round(model(x).sum().item(), 5))
    out["losses"] = losses
    out["end"] = _is_sharded(model)
    return out


def test_eval_forward_state_dict_and_training(rank_pool: RankPool) -> None:
    """An eval forward keeps the root unsharded; state_dict reshards it; training goes on."""
    for result in _run(rank_pool, "_script_eval_state_dict_and_train"):
        assert result["shard"] == result["torch"]
        shard = result["shard"]
        assert shard["after_eval"] == [True, True, False, False]
        assert shard["after_state_dict"] == [True] * 4
        assert set(shard["state_dict"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}


def _script_int_reshard_on_root(impl: str) -> dict[str, Any]:
    m = _api(impl)
    out: dict[str, Any] = {}
    x = torch.ones(2, 4)
    for value in (2, None):
        model = _two_units(m, reshard_after_forward=value)
        loss = model(x).sum()
        out[f"{value}_after_forward"] = _is_sharded(model)
        loss.backward()
        out[f"{value}_grads"] = [_full(p.grad) for p in model.parameters() if p.grad is not None]
        model.set_reshard_after_forward(True)  # replaces the int
        model(x).sum().backward()
        model(x)
        out[f"{value}_after_set_true"] = _is_sharded(model)
    return out


def test_int_reshard_after_forward_on_root(rank_pool: RankPool) -> None:
    """An int given explicitly to the root reshards it to that group size, as in torch."""
    for result in _run(rank_pool, "_script_int_reshard_on_root", 4):
        assert result["shard"] == result["torch"]
        shard = result["shard"]
        assert shard["2_after_forward"] == [True] * 4
        assert shard["None_after_forward"] == [True, True, False, False]
        assert shard["2_grads"] == shard["None_grads"]
        assert shard["2_after_set_true"] == shard["None_after_set_true"] == [True] * 4


# ---------------------------------------------------------------------- 2: signatures


def _shape(sig: inspect.Signature) -> list[tuple[str, str, object]]:
    """Names, kinds and simple defaults of a signature (annotations name each side's types)."""
    simple = (type(None), bool, int, float, str)
    return [
        (
            p.name,
            p.kind.name,
            p.default if isinstance(p.default, simple) or p.default is p.empty else "<obj>",
        )
        for p in sig.parameters.values()
    ]


def test_fsdp_module_methods_have_torch_signatures() -> None:
    """Every FSDPModule method both libraries have takes the same parameters, kinds and defaults."""
    import torch.distributed.fsdp as torch_fsdp

    ours, theirs = shard_runtime.FSDPModule, torch_fsdp.FSDPModule
    common = sorted(
        name
        for name in set(vars(theirs)) & set(vars(ours))
        if callable(getattr(theirs, name)) and not name.startswith("__")
    )
    assert {"reshard", "unshard", "reset_iter_state", "set_reshard_after_forward"} <= set(common)
    for name in common:
        assert _shape(inspect.signature(getattr(ours, name))) == _shape(
            inspect.signature(getattr(theirs, name))
        ), name
    for ours_fn, theirs_fn in [
        (shard_runtime.fully_shard, torch_fsdp.fully_shard),
        (shard_runtime.register_fsdp_forward_method, torch_fsdp.register_fsdp_forward_method),
        (shard_runtime.UnshardHandle.wait, torch_fsdp.UnshardHandle.wait),
    ]:
        assert _shape(inspect.signature(ours_fn)) == _shape(inspect.signature(theirs_fn))


# ---------------------------------------------------------------------- 3: reset_iter_state


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("backward failed")


class _Chain(nn.Module):
    """Three units; can raise in the middle of forward or of backward."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.fail_forward = False
        self.fail_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        if self.fail_backward:
            x = _FailBackward.apply(x)
        x = self.layers[1](x)
        if self.fail_forward:
            raise ValueError("forward failed")
        return self.layers[2](x)


def _script_reset_iter_state(impl: str) -> dict[str, Any]:
    m = _api(impl)
    out: dict[str, Any] = {}
    x = torch.arange(8.0).reshape(2, 4) + dist.get_rank()
    for where in ("forward", "backward"):
        torch.manual_seed(0)
        model = _Chain()
        for layer in model.layers:
            m.fully_shard(layer, mesh=_mesh())
        m.fully_shard(model, mesh=_mesh())
        optim = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(x).sum().backward()
        optim.step()
        optim.zero_grad()
        setattr(model, f"fail_{where}", True)
        out[f"{where}_raised"] = _outcome(lambda: model(x).sum().backward())  # noqa: B023
        setattr(model, f"fail_{where}", False)
        out[f"{where}_non_root"] = _outcome(model.layers[0].reset_iter_state)
        model.reset_iter_state()
        out[f"{where}_sharded_after_reset"] = _is_sharded(model)
        out[f"{where}_grad_none_after_reset"] = [p.grad is None for p in model.parameters()]
        optim.zero_grad()
        losses = []
        for _ in range(3):
            loss = model(x).sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(round(loss.item(), 4))
        out[f"{where}_losses"] = losses
        out[f"{where}_params"] = [_full(p) for p in model.parameters()]
    return out


def test_reset_iter_state_recovers_after_failed_forward_and_backward(
    rank_pool: RankPool,
) -> None:
    """After forward or backward raises half-way, reset_iter_state lets training go on."""
    for result in _run(rank_pool, "_script_reset_iter_state"):
        assert result["shard"] == result["torch"]
        shard = result["shard"]
        for where in ("forward", "backward"):
            assert shard[f"{where}_raised"] == "ValueError"
            assert shard[f"{where}_non_root"] == "RuntimeError"
            assert shard[f"{where}_sharded_after_reset"] == [True] * 6
        # layers 2 and 1 ran backward before the failure: their reductions landed
        assert shard["backward_grad_none_after_reset"] == [True, True, False, False, False, False]


# ---------------------------------------------------------------------- 4: non-root before root


class _Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2


def _generator_model(m: ModuleType) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(_Generator(), nn.Linear(4, 2))
    m.fully_shard(model[0], mesh=_mesh())
    m.fully_shard(model, mesh=_mesh())
    return model


def _script_non_root_before_root(impl: str) -> dict[str, Any]:
    m = _api(impl)
    out: dict[str, Any] = {}
    x = torch.ones(2, 4)
    model = _generator_model(m)
    m.register_fsdp_forward_method(model[0], "generate")
    m.register_fsdp_forward_method(nn.Linear(2, 2), "forward")  # not sharded: a no-op
    out["missing_method"] = _outcome(
        lambda: m.register_fsdp_forward_method(model[0], "no_such_method")
    )
    handle = model[0].unshard(async_op=True)
    out["handle"] = isinstance(handle, m.UnshardHandle)
    assert handle is not None
    handle.wait()
    out["after_wait"] = _is_sharded(model)
    loss = model(x).sum()
    loss.backward()
    out["loss"] = round(loss.item(), 5)
    out["after_backward"] = _is_sharded(model)
    out["generate"] = _full(model[0].generate(x))
    out["after_generate"] = _is_sharded(model)
    model = _generator_model(m)
    model[0].unshard()
    out["after_sync_unshard"] = _is_sharded(model)
    out["forward_after_unshard"] = _full(model(x))
    model = _generator_model(m)
    model[0].unshard(async_op=True)  # no wait: the pre-forward waits
    out["forward_after_async_unshard"] = _full(model(x))
    # A registered method run before the root's first forward makes the
    # submodule a root of its own; the real root's first forward then fails.
    model = _generator_model(m)
    m.register_fsdp_forward_method(model[0], "generate")
    out["generate_first"] = _full(model[0].generate(x))
    out["root_after"] = _outcome(lambda: model(x))
    return out


def test_unshard_and_forward_method_on_non_root_before_root_forward(
    rank_pool: RankPool,
) -> None:
    """A submodule may unshard (sync, async) and register a forward method before the root runs."""
    for result in _run(rank_pool, "_script_non_root_before_root"):
        assert result["shard"] == result["torch"]
        shard = result["shard"]
        assert shard["after_wait"] == [False, False, True, True]
        assert shard["after_sync_unshard"] == [False, False, True, True]
        assert shard["after_backward"] == [True] * 4
        assert shard["missing_method"] == "ValueError"
        assert shard["root_after"] == "RuntimeError"


# ---------------------------------------------------------------------- 5: unused parameters


class _Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.use_b = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if self.use_b:
            x = self.b(x)
        return self.head(x)


def _script_unused_params(impl: str) -> dict[str, Any]:
    m = _api(impl)
    out: dict[str, Any] = {}
    x = torch.arange(8.0).reshape(2, 4)
    for layout in ("own_units", "in_root_unit"):
        torch.manual_seed(0)
        model = _Branch()
        if layout == "own_units":
            m.fully_shard(model.a, mesh=_mesh())
            m.fully_shard(model.b, mesh=_mesh())
        m.fully_shard(model, mesh=_mesh())
        optim = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(x).sum().backward()
        out[f"{layout}_grad_none"] = [p.grad is None for p in model.parameters()]
        optim.step()
        out[f"{layout}_params"] = [_full(p) for p in model.parameters()]
        optim.zero_grad()
        model.use_b = True
        model(x).sum().backward()
        out[f"{layout}_grad_none_when_used"] = [p.grad is None for p in model.parameters()]
    return out


def test_unused_parameters_end_backward_with_grad_none(rank_pool: RankPool) -> None:
    """Parameters a forward skipped keep grad None (AdamW leaves them), in their own unit or not."""
    for result in _run(rank_pool, "_script_unused_params"):
        assert result["shard"] == result["torch"]
        shard = result["shard"]
        for layout in ("own_units", "in_root_unit"):
            assert shard[f"{layout}_grad_none"] == [False, False, True, True, False, False]
            assert shard[f"{layout}_grad_none_when_used"] == [False] * 6


# ---------------------------------------------------------------------- 6: replaced parameters


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _script_replaced_param(impl: str) -> dict[str, Any]:
    m = _api(impl)
    out: dict[str, Any] = {}
    x = torch.ones(1, 4)
    for kind in ("dtensor", "plain"):
        torch.manual_seed(0)
        model = nn.Sequential(_Holder(), nn.Linear(4, 2))
        m.fully_shard(model[0], mesh=_mesh())
        m.fully_shard(model, mesh=_mesh())
        value = torch.full((4, 4), 0.5)
        if kind == "dtensor":
            new = nn.Parameter(distribute_tensor(value, _mesh(), [Shard(0)]))
        else:
            new = nn.Parameter(value)
        model[0].lin.weight = new
        try:
            y = model(x)
        except Exception as exc:
            out[kind] = _builtin_type(exc)
            out[f"{kind}_message"] = str(exc) if impl == "shard" else ""
            continue
        y.sum().backward()
        weight = model[0].lin.weight
        out[kind] = {
            "output": _full(y),
            "adopted": weight is new,
            "weight": _full(weight),
            "local_shape": list(weight.to_local().shape),
            "has_grad": weight.grad is not None,
            "names": [name for name, _ in model.named_parameters()],
            "state_dict": {k: type(v).__name__ for k, v in model.state_dict().items()},
        }
    return out


def test_parameter_replaced_before_first_forward(rank_pool: RankPool) -> None:
    """A DTensor assigned before the first forward is adopted; a plain tensor is refused."""
    for result in _run(rank_pool, "_script_replaced_param"):
        torch_result, shard = result["torch"], result["shard"]
        assert shard["dtensor"] == torch_result["dtensor"]
        assert shard["dtensor"]["adopted"] is True
        assert shard["dtensor"]["weight"] == [0.5] * 16
        assert shard["dtensor"]["names"] == ["0.lin.weight", "0.lin.bias", "1.weight", "1.bias"]
        assert shard["plain"] == torch_result["plain"] == "AttributeError"
        assert shard["plain_message"].startswith(
            "fully_shard(0): parameter '0.lin.weight' was replaced after fully_shard by a "
            "Parameter of shape (4, 4), not a DTensor sharded like the original; assign "
            "nn.Parameter(distribute_tensor(value, mesh, [Shard(dim=0)])) instead"
        )


# ---------------------------------------------------------------------- 7: errors


class _Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class _Strided(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class _NoForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)


class _ListSubclass(nn.ModuleList):
    pass


class _ListWithForward(nn.ModuleList):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer(x)
        return x


def _script_errors(impl: str) -> dict[str, str]:
    m = _api(impl)
    mesh = _mesh()
    out = {}
    cases: dict[str, Callable[[], object]] = {
        "scalar": lambda: m.fully_shard(_Scalar(), mesh=mesh),
        "non_contiguous": lambda: m.fully_shard(_Strided(), mesh=mesh),
        "module_list": lambda: m.fully_shard(nn.ModuleList([nn.Linear(2, 2)]), mesh=mesh),
        "module_dict": lambda: m.fully_shard(nn.ModuleDict({"a": nn.Linear(2, 2)}), mesh=mesh),
        "list_subclass": lambda: m.fully_shard(_ListSubclass([nn.Linear(2, 2)]), mesh=mesh),
        "list_with_forward": lambda: m.fully_shard(_ListWithForward([nn.Linear(2, 2)]), mesh=mesh),
        "no_forward": lambda: m.fully_shard(_NoForward(), mesh=mesh),
        "not_a_module": lambda: m.fully_shard(3, mesh=mesh),
        "reshard_int_not_divisor": lambda: m.fully_shard(
            nn.Linear(2, 2), mesh=mesh, reshard_after_forward=3
        ),
        "prefetch_unsharded": lambda: m.fully_shard(
            nn.Linear(2, 2), mesh=mesh
        ).set_modules_to_forward_prefetch([nn.Linear(2, 2)]),
    }
    for name, case in cases.items():
        out[name] = _outcome(case)
    twice = nn.Linear(2, 2)
    m.fully_shard(twice, mesh=mesh)
    out["applied_twice"] = _outcome(lambda: m.fully_shard(twice, mesh=mesh))
    shared = nn.Linear(2, 2)  # one module in two separately sharded trees
    first, second = nn.Sequential(shared), nn.Sequential(shared)
    m.fully_shard(first, mesh=mesh)
    out["shared_module_two_calls"] = _outcome(lambda: m.fully_shard(second, mesh=mesh))
    tied = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))  # one parameter, two modules
    tied[1].weight = tied[0].weight
    m.fully_shard(tied[0], mesh=mesh)
    # PyTorch accepts the second call and refuses at the first forward.
    out["tied_second_call"] = _outcome(lambda: m.fully_shard(tied, mesh=mesh))
    out["tied_first_forward"] = _outcome(lambda: tied(torch.ones(1, 2)))
    return out


def _shard_messages() -> dict[str, str]:
    mesh = _mesh()
    fs = shard_runtime.fully_shard
    twice = fs(nn.Linear(2, 2), mesh=mesh)
    shared = nn.Linear(2, 2)
    fs(nn.Sequential(shared), mesh=mesh)
    tied = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    tied[1].weight = tied[0].weight
    fs(tied[0], mesh=mesh)
    fs(tied, mesh=mesh)
    return {
        "tied_first_forward": _message(lambda: tied(torch.ones(1, 2))),
        "scalar": _message(lambda: fs(_Scalar(), mesh=mesh)),
        "non_contiguous": _message(lambda: fs(_Strided(), mesh=mesh)),
        "module_list": _message(lambda: fs(nn.ModuleList([nn.Linear(2, 2)]), mesh=mesh)),
        "applied_twice": _message(lambda: fs(twice, mesh=mesh)),
        "shared_module_two_calls": _message(lambda: fs(nn.Sequential(shared), mesh=mesh)),
    }


def test_errors_have_torch_exception_types(rank_pool: RankPool) -> None:
    """Bad input raises PyTorch's exception type, at the same call (a weight tied across two
    calls: at the first forward); our messages name the culprit and the fix and include the
    words PyTorch's tests match."""
    (result,) = _run(rank_pool, "_script_errors", 1)
    assert result["shard"] == result["torch"]
    assert result["shard"] == {
        "scalar": "ValueError",
        "non_contiguous": "NotImplementedError",
        "module_list": "ValueError",
        "module_dict": "ValueError",
        "list_subclass": "ValueError",
        "list_with_forward": "ok",
        "no_forward": "ok",
        "not_a_module": "TypeError",
        "reshard_int_not_divisor": "ValueError",
        "prefetch_unsharded": "ValueError",
        "applied_twice": "AssertionError",
        "shared_module_two_calls": "TypeError",
        "tied_second_call": "ok",
        "tied_first_forward": "ValueError",
    }
    (messages,) = rank_pool.run(_shard_messages, 1)
    assert messages["scalar"].startswith(
        "fully_shard(_Scalar): parameter 'scale' is a scalar (0-d); sharding splits dim 0, so "
        "make it 1-D"
    )
    assert messages["non_contiguous"].startswith(
        "fully_shard(_Strided): parameter 'weight' is not contiguous (stride (1, 4)); make it "
        "contiguous first"
    )
    assert messages["module_list"].startswith(
        "fully_shard does not support containers that do not implement forward: ModuleList is "
        "a container without a forward, so nothing would gather its parameters; shard its "
        "children"
    )
    assert messages["tied_first_forward"] == (
        "fully_shard(Sequential): parameter '1.weight' is shared with a parameter already "
        "managed by another FSDP group, the unit of Linear ('0'); a parameter shared by two "
        "units must be in one unit: pass the modules that share it as a list to one fully_shard "
        "call (fully_shard([module_a, module_b]))"
    )
    assert messages["applied_twice"] == (
        "fully_shard: FSDPLinear is already sharded (fully_shard was applied to it before); "
        "apply fully_shard once per module, to inner modules before outer ones"
    )
    assert messages["shared_module_two_calls"].startswith(
        "fully_shard(Sequential): parameter '0.weight' is already sharded by the unit of "
        "Sequential; a parameter shared by two units must be in one unit: pass the modules "
        "that share it as a list to one fully_shard call"
    )


# ---------------------------------------------------------------------- 8: identity


def _script_identity(impl: str) -> dict[str, Any]:
    m = _api(impl)
    out: dict[str, Any] = {}
    x = torch.ones(2, 4)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    for layer in model:
        m.fully_shard(layer, mesh=_mesh())
    m.fully_shard(model, mesh=_mesh())
    out["classes"] = [type(sub).__name__ for sub in model.modules()]
    out["mro"] = [c.__name__ for c in type(model).__mro__[:4]]
    out["new_instance"] = type(type(model[0])(2, 3)).__name__
    tail = model[1:]
    out["slice"] = [type(tail).__name__, isinstance(tail, m.FSDPModule)]
    out["slice_children"] = [type(sub).__name__ for sub in tail]
    out["deepcopy_before_forward"] = _outcome(lambda: copy.deepcopy(model))
    out["deepcopy_child"] = _outcome(lambda: copy.deepcopy(model[0]))
    plain_parent = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    m.fully_shard(plain_parent[0], mesh=_mesh())
    out["deepcopy_plain_parent"] = _outcome(lambda: copy.deepcopy(plain_parent))
    out["deepcopy_unsharded"] = _outcome(lambda: copy.deepcopy(nn.Linear(2, 2)))
    y = model(x)
    out["deepcopy_after_forward"] = _outcome(lambda: copy.deepcopy(model))
    y.sum().backward()
    out["deepcopy_after_backward"] = _outcome(lambda: copy.deepcopy(model))
    out["slice_forward"] = _full(tail(x))  # after the root's first forward
    # a grouped call with no root over it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    returned = m.fully_shard([model[0], model[1]], mesh=_mesh())
    out["group_returned"] = [type(sub).__name__ for sub in returned]
    out["group_fsdp"] = [isinstance(sub, m.FSDPModule) for sub in model.modules()]
    out["group_names"] = [name for name, _ in model.named_parameters()]
    out["group_state_dict"] = list(model.state_dict())
    out["group_forward"] = _outcome(lambda: model(x))
    # the same group under a root
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(2, 2))
    m.fully_shard([model[0], model[1]], mesh=_mesh())
    m.fully_shard(model, mesh=_mesh())
    out["rooted_fsdp"] = [isinstance(sub, m.FSDPModule) for sub in model.modules()]
    loss = model(x).sum()
    out["rooted_after_forward"] = _is_sharded(model)
    loss.backward()
    out["rooted_loss"] = round(loss.item(), 5)
    out["rooted_names"] = [name for name, _ in model.named_parameters()]
    out["rooted_state_dict"] = list(model.state_dict())
    out["rooted_grads"] = [_full(p.grad) for p in model.parameters() if p.grad is not None]
    return out


def test_module_identity_slicing_deepcopy_and_grouped_root(rank_pool: RankPool) -> None:
    """FSDP<Name> classes, slices, deepcopy refusals and grouped roots look as they do in torch."""
    for result in _run(rank_pool, "_script_identity"):
        assert result["shard"] == result["torch"]
        shard = result["shard"]
        assert shard["classes"] == ["FSDPSequential", "FSDPLinear", "FSDPLinear", "FSDPLinear"]
        assert shard["mro"] == ["FSDPSequential", "FSDPModule", "Sequential", "Module"]
        assert shard["new_instance"] == "Linear"
        assert shard["slice"] == ["Sequential", False]
        assert shard["slice_children"] == ["FSDPLinear", "FSDPLinear"]
        for key in ("before_forward", "child", "plain_parent", "after_forward", "after_backward"):
            assert shard[f"deepcopy_{key}"] == "AssertionError"
        assert shard["deepcopy_unsharded"] == "ok"
        assert shard["group_fsdp"] == [False, True, True]
        assert shard["group_forward"] == "RuntimeError"
        assert shard["rooted_fsdp"] == [True, True, True, False]
        assert shard["rooted_after_forward"] == [True, True, True, True, False, False]
