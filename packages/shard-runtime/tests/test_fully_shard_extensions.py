"""The tensor-subclass all-gather contract, side by side with PyTorch's ``fully_shard``.

A parameter whose local tensor defines ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather`` decides what is gathered and how the full parameter
is rebuilt (see [Note: the tensor-subclass all-gather contract] in
``_all_gather_extension.py``). ``_Bf16Gather`` is the smallest such subclass:
it sends its shard in bf16 (half the bytes) and computes with the gathered
bf16 tensor. Every case runs the same script under PyTorch (tests only) and
shard and compares what the hooks saw, the losses and the parameters.
torchao's NF4 and float8 weights are checked in ``test_torchao.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shard_testing import RankPool
from shard_testing.compat import cpu_mesh, fsdp_namespace

# What the hooks were called with on this rank: ("pre", outer_size, stride, module, padded
# shard rows) and ("post", out given, out is the first result).
_CALLS: list[tuple[Any, ...]] = []


_aten = torch.ops.aten
# Ops whose results stay wrapped: how sharding, padding, detaching and to_empty make shards.
_KEEPS_WRAPPER = {
    _aten.split.Tensor,
    _aten.split_with_sizes.default,
    _aten.slice.Tensor,
    _aten.new_zeros.default,
    _aten.empty_like.default,
    _aten.detach.default,
    _aten.alias.default,
    _aten.view.default,
    _aten.clone.default,
    _aten._to_copy.default,
}


class _Wrapper(torch.Tensor):
    """A tensor subclass wrapping an inner tensor, as torchao's weights do.

    Shape and allocation ops keep the wrapper (so sharding and ``to_empty``
    keep it), in-place ops (the optimizer) update the inner tensor, anything
    else is plain.
    """

    _inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Wrapper:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, inner.shape, dtype=inner.dtype, device=inner.device
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self._inner = inner

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._inner!r})"

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_inner"], None

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def unwrap(t: Any) -> Any:
            return t._inner if isinstance(t, _Wrapper) else t

        plain_args = torch.utils._pytree.tree_map(unwrap, args)
        out = func(*plain_args, **torch.utils._pytree.tree_map(unwrap, kwargs or {}))
        if plain_args and out is plain_args[0]:
            return args[0]  # in place
        if func in _KEEPS_WRAPPER:
            return torch.utils._pytree.tree_map(
                lambda t: cls(t) if isinstance(t, torch.Tensor) else t, out
            )
        return out


class _Bf16Gather(_Wrapper):
    """All-gathers its shard in bf16 and computes with the gathered bf16 tensor."""

    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], object]:
        shard = self._inner
        _CALLS.append(("pre", tuple(outer_size), outer_stride, type(module).__name__, shard.shape))
        # A short shard (uneven split) must be sent padded to the longest shard's rows.
        rows = -(-outer_size[0] // mesh.size())
        padded = shard.new_zeros((rows, *shard.shape[1:]), dtype=torch.bfloat16)
        padded[: shard.shape[0]] = shard
        return (padded,), tuple(outer_size)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        (gathered,) = all_gather_outputs
        if out is not None:
            # The outputs are kept across gathers, so ``out`` already sees the new data.
            assert out.untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr()
            _CALLS.append(("post", True, str(param_dtype)))
            return None
        _CALLS.append(("post", False, str(param_dtype)))
        return gathered, (gathered,)


class _OnlyPre(_Wrapper):
    def fsdp_pre_all_gather(self, mesh: object) -> tuple[tuple[torch.Tensor, ...], object]:
        return (self._inner,), None


class _Linear(nn.Module):
    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        weight = torch.randn(rows, cols) / cols**0.5
        self.weight = nn.Parameter(_Bf16Gather(weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # while unsharded, the weight is the gathered bf16 tensor (plain)
        return (x.to(self.weight.dtype) @ self.weight.t()).float()


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 5 and 3 rows over 2 ranks: uneven shards, padded before the hook sees them
    return nn.Sequential(_Linear(5, 8), nn.ReLU(), _Linear(3, 5))


def _train(impl: str, meta_init: bool, flat: bool = False) -> dict[str, Any]:
    fsdp = fsdp_namespace(impl)  # type: ignore[arg-type]
    placement = {"shard_placement_fn": fsdp.flat_shard_placement} if flat else {}
    _CALLS.clear()
    mesh = cpu_mesh()
    reference = _model()
    if meta_init:
        with torch.device("meta"):
            model = _model()
    else:
        model = _model()
    for layer in (model[0], model[2]):
        fsdp.fully_shard(layer, mesh=mesh, **placement)
    fsdp.fully_shard(model, mesh=mesh, **placement)
    if meta_init:
        model.to_empty(device="cpu")
        with torch.no_grad():
            for (_, param), (_, full) in zip(
                model.named_parameters(), reference.named_parameters(), strict=True
            ):
                local = param._local_tensor  # type: ignore[attr-defined]
                rank, world = dist.get_rank(), dist.get_world_size()
                rows = torch.chunk(full.detach(), world)[rank] if rank < full.shape[0] else None
                if rows is not None:
                    local.copy_(rows)
    local_types = sorted(
        {type(p._local_tensor).__name__ for p in model.parameters()}  # type: ignore[attr-defined]
    )
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(2):
        loss = model(torch.randn(4, 8, generator=generator)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    shards = {n: p._local_tensor for n, p in model.named_parameters()}  # type: ignore[attr-defined]
    params = {n: getattr(t, "_inner", t).tolist() for n, t in shards.items()}
    return {"calls": list(_CALLS), "types": local_types, "losses": losses, "params": params}


@pytest.mark.parametrize("meta_init", [False, True], ids=["eager", "meta_to_empty"])
def test_five_argument_hooks_match_pytorch(rank_pool: RankPool, meta_init: bool) -> None:
    """Same hook calls (arguments, padding, out= after the first), losses and parameters."""
    theirs = rank_pool.run(_train, 2, "torch", meta_init)
    ours = rank_pool.run(_train, 2, "shard", meta_init)
    assert ours == theirs
    assert ours[0]["types"] == ["_Bf16Gather"]  # the subclass survived
    pre = [call for call in ours[1]["calls"] if call[0] == "pre"]
    assert pre[0] == ("pre", (5, 8), (8, 1), "FSDP_Linear", torch.Size((2, 8)))  # a short shard
    posts = [call for call in ours[0]["calls"] if call[0] == "post"]
    assert [out for _, out, _ in posts] == [False, False, True, True, True, True, True, True]


def test_flat_placement_keeps_subclasses_on_rows(rank_pool: RankPool) -> None:
    """flat_shard_placement leaves a subclass on Shard(0) rows: PyTorch's default results."""
    theirs = rank_pool.run(_train, 2, "torch", False)
    ours = rank_pool.run(_train, 2, "shard", False, True)
    assert ours == theirs


def _one_hook(impl: str) -> str:
    fsdp = fsdp_namespace(impl)  # type: ignore[arg-type]
    layer = nn.Linear(4, 4)
    layer.weight = nn.Parameter(_OnlyPre(layer.weight.detach()))
    try:
        fsdp.fully_shard(layer, mesh=cpu_mesh())
    except AssertionError as exc:
        return str(exc)
    return "no error"


def test_a_subclass_with_one_hook_is_refused_as_pytorch_refuses_it(rank_pool: RankPool) -> None:
    theirs = rank_pool.run(_one_hook, 2, "torch")[0]
    ours = rank_pool.run(_one_hook, 2, "shard")[0]
    phrase = "Both fsdp_pre_all_gather and fsdp_post_all_gather should be defined"
    assert phrase in theirs
    assert ours == (
        "fully_shard: parameter 'weight' is a _OnlyPre that defines fsdp_pre_all_gather but not "
        f"fsdp_post_all_gather. {phrase} if using all-gather extensions"
    )


def _wrapped_subclass() -> str:
    from shard_runtime import FullyShardedDataParallel

    layer = nn.Linear(4, 4)
    layer.weight = nn.Parameter(_Bf16Gather(layer.weight.detach()))
    try:
        FullyShardedDataParallel(layer)
    except TypeError as exc:
        return str(exc)
    return "no error"


def test_the_wrapper_refuses_subclass_parameters_by_name(rank_pool: RankPool) -> None:
    assert rank_pool.run(_wrapped_subclass, 2)[0] == (
        "FullyShardedDataParallel(Linear): parameter 'weight' is a _Bf16Gather, a tensor "
        "subclass; the wrapper's flat buffer holds plain tensors only. Shard this module "
        "with fully_shard, which keeps the subclass and its fsdp_pre_all_gather/"
        "fsdp_post_all_gather hooks"
    )
