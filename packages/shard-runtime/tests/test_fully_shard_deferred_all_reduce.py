"""set_requires_all_reduce defers HSDP's replica all-reduce without changing the gradient."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from shard_comms import count_collectives
from shard_runtime import FSDPModule, fully_shard
from shard_runtime._state import states_in
from shard_testing import RankPool


def _blocks_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))


def _deferred_all_reduce(defer: bool) -> dict[str, torch.Tensor]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _blocks_model()
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    root: FSDPModule = model  # type: ignore[assignment]
    g = torch.Generator().manual_seed(7)
    data = [torch.randn(4, 4, generator=g) for _ in range(2 * dist.get_world_size())]
    rank = dist.get_rank()
    with count_collectives() as counts:
        for micro in range(2):
            root.set_requires_all_reduce(not defer or micro == 1)
            model(data[2 * rank + micro]).sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    grads["all_reduces"] = torch.tensor(counts.calls("all_reduce"))
    # Reductions or partials left once every reduction has landed (none may stay behind).
    reductions = [s.unit.reductions for s in states_in([model])]
    grads["left_over"] = torch.tensor(sum(bool(r.issued or r.partials) for r in reductions))
    return grads


def test_deferred_replica_all_reduce(rank_pool: RankPool) -> None:
    """set_requires_all_reduce(False) defers the replica all-reduce; the gradient is unchanged."""
    eager = rank_pool.run(_deferred_all_reduce, 4, False)[0]
    for deferred in rank_pool.run(_deferred_all_reduce, 4, True):
        assert int(eager["all_reduces"]) == 4
        assert int(deferred["all_reduces"]) == 2
        assert int(deferred["left_over"]) == 0
        for key in ("0.weight", "2.weight", "4.bias"):
            torch.testing.assert_close(deferred[key], eager[key])


def _freeze_while_deferred() -> dict[str, object]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _blocks_model()
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    root: FSDPModule = model  # type: ignore[assignment]
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    root.set_requires_all_reduce(False)
    model(x).sum().backward()  # the replica sums wait as partials
    model[2].weight.requires_grad_(False)
    try:
        model(x)
    except RuntimeError as exc:
        return {"error": str(exc)}
    return {"error": None}


def test_requires_grad_change_while_the_replica_all_reduce_waits_is_refused(
    rank_pool: RankPool,
) -> None:
    """Freezing a parameter whose unit holds a deferred replica partial names the unit and fix.

    The partial was reduce-scattered over the old set of trainable parameters,
    so the next forward (where the change is read) refuses it instead of
    all-reducing a partial of another layout.
    """
    for result in rank_pool.run(_freeze_while_deferred, 4):
        assert result["error"] == (
            "fully_shard(2): requires_grad of a parameter of 2.weight, 2.bias changed while its "
            "gradients wait for the replica all-reduce (set_requires_all_reduce(False)); change "
            "requires_grad after a backward with set_requires_all_reduce(True)"
        )
