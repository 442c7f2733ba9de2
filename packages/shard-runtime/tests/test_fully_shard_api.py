"""fully_shard behaves as a PyTorch FSDP2 user expects, and bad input fails clearly."""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from shard_runtime import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from shard_testing import RankPool
from shard_testing.compat import cpu_mesh as _mesh
from shard_testing.compat import error as _error

# ---------------------------------------------------------------------- surface


def _class_and_state_dict() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3))
    fully_shard(model[0], mesh=_mesh())
    fully_shard(model, mesh=_mesh())
    sd = model.state_dict()
    return {
        "isinstance": [isinstance(model, FSDPModule), isinstance(model, nn.Sequential)],
        "class": type(model).__name__,
        "keys": list(sd),
        "dtensor": all(isinstance(v, DTensor) for v in sd.values()),
        "placements": [tuple(v.placements) for v in sd.values()],
        "local_shapes": [tuple(v.to_local().shape) for v in sd.values()],
        "deepcopy": _error(lambda: copy.deepcopy(model)),
    }


def test_class_swap_state_dict_and_deepcopy(rank_pool: RankPool) -> None:
    """The class becomes FSDP<cls>; state_dict holds chunk-cut Shard(0) DTensors; no deepcopy."""
    rank0, rank1 = rank_pool.run(_class_and_state_dict, 2)
    assert rank0["isinstance"] == [True, True]
    assert rank0["class"] == "FSDPSequential"
    assert rank0["keys"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert rank0["dtensor"] is True
    assert rank0["placements"] == [(Shard(0),)] * 4
    assert rank0["local_shapes"] == [(3, 4), (3,), (2, 5), (2,)]
    assert rank1["local_shapes"] == [(2, 4), (2,), (1, 5), (1,)]
    assert rank0["deepcopy"].startswith(
        "AssertionError: FSDPSequential is sharded by fully_shard and cannot be deep-copied"
    )


def _empty_shards() -> list[tuple[int, ...]]:
    model = nn.Linear(4, 2)  # 2 rows over 4 ranks: ranks 2 and 3 hold nothing
    fully_shard(model, mesh=_mesh())
    return [tuple(p.to_local().shape) for p in model.parameters()]


def test_uneven_and_empty_shards(rank_pool: RankPool) -> None:
    """Two rows over four ranks give shards of 1, 1, 0 and 0 rows, like torch.chunk."""
    shapes = rank_pool.run(_empty_shards, 4)
    assert shapes == [[(1, 4), (1,)], [(1, 4), (1,)], [(0, 4), (0,)], [(0, 4), (0,)]]


# ---------------------------------------------------------------------- errors


class _Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class _Strided(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def _errors() -> dict[str, str]:
    mesh = _mesh()
    shared = nn.Linear(3, 3)
    a, b = nn.Sequential(shared), nn.Sequential(shared)
    fully_shard(a, mesh=mesh)
    tied = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    tied[1].weight = tied[0].weight
    fully_shard(tied[0], mesh=mesh)
    fully_shard(tied, mesh=mesh)  # accepted, as in PyTorch: the first forward refuses
    # An embedding tied to a sibling's head: the other unit is outside the second call.
    siblings = nn.Sequential(nn.Embedding(4, 3), nn.Linear(3, 4, bias=False))
    siblings[1].weight = siblings[0].weight
    fully_shard(siblings[0], mesh=mesh)
    fully_shard(siblings[1], mesh=mesh)
    fully_shard(siblings, mesh=mesh)
    child_first = nn.Sequential(nn.Linear(2, 2))
    fully_shard(child_first[0], mesh=mesh)
    fully_shard(child_first, mesh=mesh)
    child_first[0](torch.ones(1, 2))  # allowed: it becomes the root of its own subtree
    return {
        "modulelist": _error(lambda: fully_shard(nn.ModuleList([nn.Linear(2, 2)]), mesh=mesh)),
        "moduledict": _error(lambda: fully_shard(nn.ModuleDict({"a": nn.Linear(2, 2)}), mesh=mesh)),
        "scalar": _error(lambda: fully_shard(_Scalar(), mesh=mesh)),
        "strided": _error(lambda: fully_shard(_Strided(), mesh=mesh)),
        "shared": _error(lambda: fully_shard(b, mesh=mesh)),
        "tied": _error(lambda: tied(torch.ones(1, 3))),
        "tied_siblings": _error(lambda: siblings(torch.zeros(1, 2, dtype=torch.long))),
        "mesh3d": _error(
            lambda: fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1, 1, 1)))
        ),
        "mesh2d_unnamed": _error(
            lambda: fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1, 1)))
        ),
        "child_first": _error(lambda: child_first(torch.ones(1, 2))),
        "int_reshard": _error(
            lambda: fully_shard(nn.Linear(2, 2), mesh=mesh, reshard_after_forward=3)
        ),
    }


def test_errors_name_the_culprit(rank_pool: RankPool) -> None:
    """Each bad input raises an exception naming the module or parameter and the fix."""
    (errors,) = rank_pool.run(_errors, 1)
    assert errors["modulelist"].startswith(
        "ValueError: fully_shard does not support containers that do not implement forward: "
        "ModuleList is a container without a forward, so nothing would gather its parameters; "
        "shard its children instead"
    )
    assert errors["moduledict"].startswith(
        "ValueError: fully_shard does not support containers that do not implement forward: "
        "ModuleDict is a container without a forward"
    )
    assert errors["scalar"] == (
        "LayoutError: fully_shard(_Scalar): parameter 'scale' is a scalar (0-d); sharding splits "
        "dim 0, so make it 1-D, e.g. nn.Parameter(value.reshape(1))"
    )
    assert errors["strided"].startswith(
        "NotImplementedError: fully_shard(_Strided): parameter 'weight' is not contiguous "
        "(stride (1, 3))"
    )
    assert errors["shared"].startswith(
        "TypeError: fully_shard(Sequential): parameter '0.weight' is already sharded by the unit "
        "of Sequential; a parameter shared by two units must be in one unit"
    )
    assert errors["tied"].startswith(
        "ValueError: fully_shard(Sequential): parameter '1.weight' is shared with a parameter "
        "already managed by another FSDP group, the unit of Linear ('0'); a parameter shared by "
        "two units must be in one unit: pass the modules that share it as a list to one "
        "fully_shard call"
    )
    # Named by its path under the root, found at the first forward (at the call, only its class
    # was known).
    assert errors["tied_siblings"].startswith(
        "ValueError: fully_shard(Linear): parameter 'weight' is shared with a parameter already "
        "managed by another FSDP group, the unit of Embedding ('0'); a parameter shared by two "
        "units must be in one unit"
    )
    assert errors["mesh3d"].startswith("ValueError: fully_shard: mesh must be 1-D (shard) or 2-D")
    assert errors["mesh2d_unnamed"].startswith(
        "AssertionError: fully_shard: a 2-D mesh needs axis names"
    )
    assert errors["child_first"] == (
        "RuntimeError: fully_shard: Linear ('0') already ran forward as a root before the first "
        "forward of Sequential, the sharded module that contains it; run the outermost sharded "
        "module's forward first (it sets up the whole tree), then submodules may run on their own"
    )
    assert errors["int_reshard"] == (
        "ValueError: fully_shard: reshard_after_forward must be True, False or an int that "
        "divides the shard axis size 1 (the group size to reshard to after forward), got 3"
    )


def _meta_flow() -> dict[str, Any]:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model[0], mesh=_mesh())
    fully_shard(model, mesh=_mesh())
    before = _error(lambda: model(torch.ones(1, 4)))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        # torch's own note that DTensor random ops are incomplete on CPU meshes
        warnings.filterwarnings("ignore", "DTensor random operators", UserWarning)
        for m in model:
            m.reset_parameters()  # type: ignore[operator]
    out = model(torch.ones(2, 4))
    out.sum().backward()
    return {
        "before": before,
        "shape": tuple(out.shape),
        "grads": all(p.grad is not None for p in model.parameters()),
        "device": {p.to_local().device.type for p in model.parameters()},
    }


def test_meta_device_flow(rank_pool: RankPool) -> None:
    """Forward on meta parameters names them; after to_empty and init, training works."""
    (result,) = rank_pool.run(_meta_flow, 2)[:1]
    assert result["before"] == (
        "RuntimeError: fully_shard: parameters are still on the meta device: 0.weight, 0.bias, "
        "1.weight, 1.bias; call module.to_empty(device=...) and initialize them before the first "
        "forward"
    )
    assert result["shape"] == (2, 2)
    assert result["grads"] is True
    assert result["device"] == {"cpu"}


# ---------------------------------------------------------------------- features


@dataclasses.dataclass
class _Out:
    value: torch.Tensor
    extra: dict[str, torch.Tensor]


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> tuple[_Out, torch.Tensor]:
        h = self.frozen(self.a(x))
        return _Out(h, {"twice": h * 2}), h.sum()


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.nested = _Nested()
        self.reused = nn.Linear(3, 3)
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, total = self.nested(x)
        y = self.reused(self.reused(out.extra["twice"]))
        return y.sum() + total


def _nested_reused_unused(shard: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = _Outer()
    if shard:
        mesh = _mesh()
        for name in ("nested", "reused", "unused"):
            fully_shard(getattr(model, name), mesh=mesh)
        fully_shard(model, mesh=mesh)
    loss = model(torch.arange(6.0).reshape(2, 3))
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads[name] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
    return grads


def test_nested_outputs_reused_unused_and_frozen(rank_pool: RankPool) -> None:
    """Nested dataclass outputs, a module run twice, an unused unit, frozen params: exact grads."""
    expected = _nested_reused_unused(False)
    for grads in rank_pool.run(_nested_reused_unused, 2, True):
        assert sorted(grads) == sorted(expected)
        for key, value in expected.items():
            torch.testing.assert_close(grads[key], value)


def _mixed_precision() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    seen: list[torch.dtype] = []
    model[1].register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
    )
    fully_shard(model[1], mesh=_mesh(), mp_policy=policy)
    fully_shard(model, mesh=_mesh(), mp_policy=policy)
    out = model(torch.ones(3, 4))
    out.sum().backward()
    return {
        "compute": seen,
        "output": out.dtype,
        "sharded": sorted({str(p.dtype) for p in model.parameters()}),
        "grads": sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}),
    }


def test_bf16_compute_fp32_shards(rank_pool: RankPool) -> None:
    """With param_dtype=bf16 forward computes in bf16; shards and their gradients stay fp32."""
    result = rank_pool.run(_mixed_precision, 2)[0]
    assert result["compute"] == [torch.bfloat16]
    assert result["output"] == torch.float32
    assert result["sharded"] == ["torch.float32"]
    assert result["grads"] == ["torch.float32"]


def _clip_and_dtype() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    fully_shard(model[0], mesh=_mesh())
    fully_shard(model, mesh=_mesh())
    model(torch.ones(2, 5)).pow(2).sum().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    total = norm.full_tensor() if isinstance(norm, DTensor) else norm
    model.to(torch.float64)
    out = model(torch.ones(2, 5, dtype=torch.float64))
    return {
        "norm": float(total),
        "dtype": out.dtype,
        "param_dtype": {p.dtype for p in model.parameters()},
    }


def test_clip_grad_norm_and_to_dtype(rank_pool: RankPool) -> None:
    """clip_grad_norm_ on sharded gradients returns the global norm; model.to(dtype) then works."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    model(torch.ones(2, 5)).pow(2).sum().backward()
    expected = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0))
    for result in rank_pool.run(_clip_and_dtype, 3):
        assert result["norm"] == pytest.approx(expected, rel=1e-6)
        assert result["dtype"] == torch.float64
        assert result["param_dtype"] == {torch.float64}


class _Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.proj(x))


def _forward_method() -> list[int]:
    torch.manual_seed(0)
    model = _Generator()
    fully_shard(model, mesh=_mesh())
    register_fsdp_forward_method(model, "generate")
    model(torch.ones(1, 3))
    return list(model.generate(torch.ones(1, 3)).shape)


def test_register_fsdp_forward_method(rank_pool: RankPool) -> None:
    """A registered method runs with gathered parameters like forward."""
    assert rank_pool.run(_forward_method, 2) == [[1, 3], [1, 3]]
