"""FSDPModule's communication controls give the gradients PyTorch's fully_shard gives.

One script runs under PyTorch's ``fully_shard`` and under shard's, changing
only the import; each case sets one control (or two) and the test compares
the sharded gradients, the losses, what an all-reduce hook saw and how often
a custom collective was called. PyTorch's own ``set_gradient_divide_factor``
needs ``ReduceOp.PREMUL_SUM``, which gloo lacks, so on the CPU it runs only
together with ``set_force_sum_reduction_for_comms(True)``.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import shard_runtime
from shard_testing import RankPool
from shard_testing.compat import BranchNet, CountingAllGather, CountingReduceScatter


def _script(impl: str, case: str) -> dict[str, Any]:
    """Two steps of the same user code under ``impl``; ``case`` names the controls set."""
    if impl == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from shard_runtime import MixedPrecisionPolicy, fully_shard
    flags = set(case.split("+"))
    world = dist.get_world_size()
    if "hsdp" in flags:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = BranchNet()
    # fp16 reductions: the force-sum division splits around the sum against overflow.
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float16 if "fp16" in flags else None)
    for child in (model.emb, model.l1, model.side):
        fully_shard(child, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)  # the root holds l2
    root: Any = model
    seen: list[list[float]] = []
    gather, scatter = CountingAllGather(), CountingReduceScatter()

    def hook(output: torch.Tensor) -> None:
        seen.append(output.tolist())
        output.mul_(2.0)  # in place: the sharded gradient doubles

    if "factor" in flags:
        root.set_gradient_divide_factor(3.0)
    if "sum" in flags:
        root.set_force_sum_reduction_for_comms(True)
    if "l1sum" in flags:
        model.l1.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    if "hook" in flags:
        root.set_all_reduce_hook(hook)
    if "noub" in flags:
        model.emb.set_unshard_in_backward(False)  # type: ignore[operator]
    if "custom" in flags:
        model.l1.set_custom_all_gather(gather)  # type: ignore[operator]
        model.l1.set_custom_reduce_scatter(scatter)  # type: ignore[operator]
    if "unused" in flags:
        root.set_reduce_scatter_unused_params(True)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + dist.get_rank())
    losses, grads = [], {}
    for _ in range(2):
        x = torch.randint(0, 10, (5,))
        out, side = model(x)
        loss = out.square().sum()
        if not flags & {"unused", "side_unused"}:  # otherwise no rank's loss reaches `side`
            loss = loss + side.sum()
        loss.backward()
        losses.append(loss.item())
        grads = {
            name: None if p.grad is None else p.grad.to_local().flatten().tolist()
            for name, p in model.named_parameters()
        }
        optim.step()
        optim.zero_grad(set_to_none=False)
    return {
        "losses": losses,
        "grads": grads,
        "hook_seen": seen,
        "custom_calls": (gather.calls, scatter.calls),
    }


def _compare(rank_pool: RankPool, world: int, case: str) -> list[dict[str, Any]]:
    theirs = rank_pool.run(_script, world, "torch", case)
    ours = rank_pool.run(_script, world, "shard", case)
    for rank, (t, s) in enumerate(zip(theirs, ours, strict=True)):
        assert s["losses"] == pytest.approx(t["losses"], rel=1e-6), f"rank {rank}"
        assert list(s["grads"]) == list(t["grads"])
        for name, grad in t["grads"].items():
            if grad is None:
                assert s["grads"][name] is None, f"rank {rank} {name}"
            else:
                assert s["grads"][name] == pytest.approx(grad, rel=1e-5, abs=1e-6), (
                    f"rank {rank} {name}"
                )
        assert len(s["hook_seen"]) == len(t["hook_seen"])
        for got, want in zip(s["hook_seen"], t["hook_seen"], strict=True):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert s["custom_calls"] == t["custom_calls"]
    return ours


_METHODS = [
    "set_all_reduce_hook",
    "set_allocate_memory_from_process_group_for_comm",
    "set_custom_all_gather",
    "set_custom_reduce_scatter",
    "set_force_sum_reduction_for_comms",
    "set_gradient_divide_factor",
    "set_reduce_scatter_divide_factor",
    "set_reduce_scatter_max_input_buffers",
    "set_reduce_scatter_unused_params",
    "set_separate_reduce_scatter_group",
    "set_symm_mem_for_comm",
    "set_unshard_in_backward",
]


def _shape(fn: Any) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", _METHODS)
def test_method_signature_matches_torch(name: str) -> None:
    """Each control has PyTorch's parameter names, kinds (keyword-only markers) and defaults."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    ours = getattr(shard_runtime.FSDPModule, name)
    assert _shape(ours) == _shape(getattr(TorchFSDPModule, name))


def test_share_comm_ctx_signature_matches_torch() -> None:
    """share_comm_ctx is exported with PyTorch's signature."""
    from torch.distributed.fsdp import share_comm_ctx

    assert "share_comm_ctx" in shard_runtime.__all__
    assert _shape(shard_runtime.share_comm_ctx) == _shape(share_comm_ctx)


@pytest.mark.parametrize(
    "case",
    [
        "plain",
        "factor+sum",
        "sum",
        "hook",
        "hook+sum",
        "hook+sum+fp16",
        "noub",
        "custom",
        "side_unused",
        "unused",
    ],
)
def test_controls_match_torch_on_two_ranks(rank_pool: RankPool, case: str) -> None:
    """On a 1-D mesh of 2 ranks, each control gives PyTorch's gradients, losses and hook inputs."""
    ours = _compare(rank_pool, 2, case)
    if "custom" in case:
        assert ours[0]["custom_calls"] == (4, 2)  # per step: forward + backward gather, 1 reduce
    if "hook" in case:
        assert len(ours[0]["hook_seen"]) == 2  # once per backward, for the root's unit
    if case == "side_unused":
        assert ours[0]["grads"]["side.weight"] is None
    if case == "unused":
        assert ours[0]["grads"]["side.weight"] == [0.0] * 8  # rank 0 holds 2 of 3 rows


@pytest.mark.parametrize(
    "case", ["hsdp", "hsdp+factor+sum", "hsdp+hook", "hsdp+hook+sum", "hsdp+hook+fp16"]
)
def test_controls_match_torch_on_2x2_hybrid_mesh(rank_pool: RankPool, case: str) -> None:
    """On a 2x2 (replicate, shard) mesh the divide factor and the hook act as in PyTorch."""
    ours = _compare(rank_pool, 4, case)
    if "hook" in case:
        assert len(ours[0]["hook_seen"]) == 2
