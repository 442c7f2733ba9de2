"""fully_shard over tensor-parallel blocks trains and checkpoints as PyTorch's fully_shard does."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from shard_testing import RankPool
from shard_testing.compat import TPModel as Model

STEPS = 3


def _placements(value: torch.Tensor) -> list[str]:
    assert isinstance(value, DTensor)
    return [str(p) for p in value.placements]


def _mesh_names(value: torch.Tensor) -> tuple[str, ...] | None:
    assert isinstance(value, DTensor)
    return value.device_mesh.mesh_dim_names


def _tp_fsdp(impl: str, shape: tuple[int, ...], names: tuple[str, ...]) -> dict[str, Any]:
    """Parallelize blocks over "tp", fully_shard them over the other axes, train, checkpoint."""
    if impl == "torch":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )
        from torch.distributed.fsdp import fully_shard
    else:
        from shard_checkpoint import StateDictOptions, get_model_state_dict
        from shard_runtime import fully_shard
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp_names = names[:-1]
    dp_mesh: DeviceMesh = mesh[dp_names[0]] if len(dp_names) == 1 else mesh[dp_names]
    torch.manual_seed(0)
    model = Model()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)

    seen: dict[str, Any] = {}

    def record(module: nn.Module, _args: object) -> None:
        if "up" not in seen:
            weight = module.weight
            seen["up"] = (
                type(weight).__name__,
                _mesh_names(weight),
                _placements(weight),
                tuple(weight.shape),
                tuple(weight.to_local().shape),  # type: ignore[operator]
            )

    model.blocks[0].up.register_forward_pre_hook(record)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    # Inputs differ across data-parallel ranks and agree within a tp group.
    dp_rank = dist.get_rank() // mesh.size(len(names) - 1)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + dp_rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if step == 0:
            seen["grads"] = {n: _placements(p.grad) for n, p in model.named_parameters()}
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    sd = model.state_dict()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {
        "losses": losses,
        "params": {
            n: (_mesh_names(p), _placements(p), tuple(p.shape), tuple(p.to_local().shape))
            for n, p in model.named_parameters()
        },
        "unsharded_up": seen["up"],
        "grads": seen["grads"],
        "state_dict": {
            k: (_placements(v), tuple(v.to_local().shape), v.full_tensor().tolist())
            for k, v in sd.items()
        },
        "full_state_dict": {k: v.tolist() for k, v in full.items()},
    }


def _compare(rank_pool: RankPool, shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    world = 1
    for size in shape:
        world *= size
    ref = rank_pool.run(_tp_fsdp, world, "torch", shape, names)
    ours = rank_pool.run(_tp_fsdp, world, "shard", shape, names)
    for rank, (theirs, mine) in enumerate(zip(ref, ours, strict=True)):
        for key in theirs:
            assert mine[key] == theirs[key], f"rank {rank}: {key} differs"
    return ours


def test_fsdp_over_tp_matches_torch_bitwise(rank_pool: RankPool) -> None:
    """dp x tp (2 x 2): placements, tp compute faces, grads, losses, state dicts equal torch's."""
    ours = _compare(rank_pool, (2, 2), ("dp", "tp"))
    params = ours[0]["params"]
    assert params["blocks.0.up.weight"] == (
        ("dp", "tp"),
        ["_S(0, 2)", "S(0)"],
        (12, 8),
        (3, 8),
    )
    assert params["blocks.0.down.weight"] == (("dp", "tp"), ["S(0)", "S(1)"], (8, 12), (4, 6))
    assert params["blocks.0.down.bias"] == (("dp", "tp"), ["S(0)", "R"], (8,), (4,))
    assert params["head.weight"] == (("dp",), ["S(0)"], (3, 8), (2, 8))
    # 5 tp-local rows of blocks.1.up split 3 + 2 over dp.
    assert [r["params"]["blocks.1.up.weight"][3] for r in ours] == [(3, 8), (3, 8), (2, 8), (2, 8)]
    assert ours[0]["unsharded_up"] == ("DTensor", ("tp",), ["S(0)"], (12, 8), (6, 8))
    assert ours[0]["losses"] != ours[2]["losses"]  # dp ranks saw different data


def test_hsdp_over_tp_matches_torch_bitwise(rank_pool: RankPool) -> None:
    """replicate x shard x tp (2 x 1 x 2) on 4 ranks: the same as torch, replicas agree."""
    ours = _compare(rank_pool, (2, 1, 2), ("replicate", "shard", "tp"))
    assert ours[0]["params"]["blocks.0.up.weight"] == (
        ("replicate", "shard", "tp"),
        ["R", "_S(0, 2)", "S(0)"],  # strided even over a shard axis of 1, as torch
        (12, 8),
        (6, 8),
    )
    assert ours[0]["full_state_dict"] == ours[2]["full_state_dict"]


def _tp_mixed_precision_reload(impl: str) -> dict[str, Any]:
    """bf16 compute over dp x tp: loss and fp32 grads; a second model loads the first's state."""
    if impl == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from shard_runtime import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def build(seed: int) -> Model:
        torch.manual_seed(seed)
        model = Model()
        for block in model.blocks:
            plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
            parallelize_module(block, mesh["tp"], plan)  # type: ignore[arg-type]
            fully_shard(block, mesh=mesh["dp"], mp_policy=mp)
        fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
        return model

    model = build(0)
    seen: list[Any] = []
    model.blocks[0].up.register_forward_pre_hook(
        lambda m, _: seen.append((str(m.weight.dtype), type(m.weight).__name__))
    )
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank() // 2))
    loss = model(x).float().pow(2).mean()
    loss.backward()
    grad = model.blocks[0].up.weight.grad
    assert isinstance(grad, DTensor)
    other = build(1)
    other.load_state_dict(model.state_dict())
    return {
        "loss": loss.item(),
        "compute": seen[0],
        "grad": (str(grad.dtype), grad.full_tensor().tolist()),
        "reloaded": [
            torch.equal(a.full_tensor(), b.full_tensor())  # type: ignore[attr-defined]
            for a, b in zip(model.parameters(), other.parameters(), strict=True)
        ],
    }


def test_fsdp_over_tp_mixed_precision_and_reload_match_torch(rank_pool: RankPool) -> None:
    """bf16 tp compute faces, fp32 gradients equal torch's; load_state_dict round-trips."""
    ref = rank_pool.run(_tp_mixed_precision_reload, 4, "torch")
    ours = rank_pool.run(_tp_mixed_precision_reload, 4, "shard")
    assert ours == ref
    assert ours[0]["compute"] == ("torch.bfloat16", "DTensor")
    assert ours[0]["grad"][0] == "torch.float32"
    assert all(all(r["reloaded"]) for r in ours)


def _tp_meta_init(impl: str) -> dict[str, Any]:
    """Build on meta, parallelize, shard, to_empty, fill, cast to float64, train two steps."""
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from shard_runtime import fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = Model()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            param.fill_(0.01 * (index + 1))
    model = model.double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + dist.get_rank() // 2)
        loss = model(torch.randn(4, 8, generator=g, dtype=torch.float64)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": {
            n: (str(p.dtype), p.full_tensor().tolist())  # type: ignore[attr-defined]
            for n, p in model.named_parameters()
        },
    }


def test_fsdp_over_tp_meta_init_and_cast_match_torch(rank_pool: RankPool) -> None:
    """Meta-device init, to_empty and .double() over dp x tp train exactly as torch."""
    ref = rank_pool.run(_tp_meta_init, 4, "torch")
    ours = rank_pool.run(_tp_meta_init, 4, "shard")
    assert ours == ref
    assert ours[0]["params"]["blocks.0.up.weight"][0] == "torch.float64"
