"""The default gradient reducer, running a comm hook in its place, and choosing hooks by name."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shard_comms as sc
from shard_comms import _hooks, plumbing
from shard_core import Registry, hookimpl, make_plugin_manager
from shard_core.errors import CommError, PluginCallError, UnknownPluginNameError
from shard_core.protocols import CommHook, GradReducer


def _values(seed: int, numel: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, (numel,), generator=generator).to(torch.float32) / 4


def _bf16_hook(reducer: GradReducer, grad: torch.Tensor, output: torch.Tensor | None) -> None:
    """Compress to bf16, reduce, decompress: the shape of the lowp plugin's hooks."""
    low = grad.to(torch.bfloat16)
    low_out = None if output is None else torch.empty(output.numel(), dtype=torch.bfloat16)
    reducer.reduce(low, low_out)
    if output is None:
        grad.copy_(low)
    else:
        assert low_out is not None
        output.copy_(low_out)


# ---------------------------------------------------------------------------
# Functions run on every rank
# ---------------------------------------------------------------------------


def _rank_reduce(numel: int, sharded: bool, hook: Any) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    reducer = sc.DefaultGradReducer(label="layers.0")
    grad = _values(rank, numel * world)
    output = torch.empty(numel) if sharded else None
    with sc.count_collectives() as counts:
        sc.reduce_gradient(grad, output, reducer, hook)
    return {
        "result": grad if output is None else output,
        "protocol": isinstance(reducer, GradReducer),
        "factors": (reducer.world_size, reducer.pre_divide, reducer.post_divide),
        "counts": counts.as_dict(),
        "labels": sorted(counts.labels()),
    }


def _rank_hybrid(numel: int) -> dict[str, Any]:
    rank = dist.get_rank()
    mesh = sc.build_mesh((2, 2))
    shard_group, replicate_group = sc.mesh_groups(mesh)
    reducer = sc.DefaultGradReducer(shard_group, replicate_group=replicate_group)
    output = torch.empty(numel)
    with sc.count_collectives() as counts:
        reducer.reduce(_values(rank, numel * 2), output)
    return {
        "output": output,
        "sizes": (reducer.world_size, reducer.data_parallel_size),
        "factors": (reducer.pre_divide, reducer.post_divide),
        "calls": (counts.calls("reduce_scatter"), counts.calls("all_reduce")),
    }


def _rank_halves(numel: int) -> dict[str, Any]:
    rank = dist.get_rank()
    mesh = sc.build_mesh((2, 2))
    shard_group, replicate_group = sc.mesh_groups(mesh)
    reducer = sc.DefaultGradReducer(
        shard_group, replicate_group=replicate_group, op="sum", pre_divide=2.0, post_divide=4.0
    )
    output = torch.empty(numel)
    with sc.count_collectives() as counts:
        result, work = reducer.scatter(_values(rank, numel * 2), output, async_op=True)
        work.wait()
        reducer.all_reduce_replicas(result)
    return {
        "same": result is output,
        "output": output,
        "factors": (reducer.pre_divide, reducer.scatter_post_divide, reducer.post_divide),
        "calls": (counts.calls("reduce_scatter"), counts.calls("all_reduce")),
    }


# ---------------------------------------------------------------------------
# The default reducer
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_default_reducer_averages_into_each_ranks_shard(rank_pool: Any, world_size: int) -> None:
    """reduce(grad, output) is a reduce-scatter averaging over the world, with default factors."""
    results = rank_pool.run(_rank_reduce, world_size, 3, True, None)
    pre, post = plumbing.divide_factors(world_size)
    total = torch.stack([_values(r, 3 * world_size) / pre for r in range(world_size)]).sum(0)
    expected = total / post
    for rank, result in enumerate(results):
        assert torch.equal(result["result"], expected[rank * 3 : (rank + 1) * 3])
        assert result["protocol"] is True
        assert result["factors"] == (world_size, pre, post)
        calls = 0 if world_size == 1 else 1
        assert result["counts"]["reduce_scatter"]["calls"] == calls
        assert result["labels"] == ([] if world_size == 1 else ["layers.0"])


def test_default_reducer_all_reduces_unsharded_gradients(rank_pool: Any) -> None:
    """reduce(grad, None) averages grad in place with one all-reduce."""
    results = rank_pool.run(_rank_reduce, 4, 2, False, None)
    expected = torch.stack([_values(r, 8) / 2 for r in range(4)]).sum(0) / 2
    for result in results:
        assert torch.equal(result["result"], expected)
        assert result["counts"]["all_reduce"] == {"calls": 1, "bytes": 32}


def test_hybrid_reducer_averages_over_shard_and_replicate_axes(rank_pool: Any) -> None:
    """On a 2x2 mesh the shard is reduce-scattered in its node, then all-reduced across nodes."""
    results = rank_pool.run(_rank_hybrid, 4, 3)
    total = torch.stack([_values(r, 6) / 2 for r in range(4)]).sum(0) / 2
    for rank, result in enumerate(results):
        shard_rank = rank % 2
        assert torch.equal(result["output"], total[shard_rank * 3 : (shard_rank + 1) * 3])
        assert result["sizes"] == (2, 4)
        assert result["factors"] == (2.0, 2.0)
        assert result["calls"] == (1, 1)


def test_reducer_halves_apply_explicit_sum_factors_once(rank_pool: Any) -> None:
    """scatter (async) then all_reduce_replicas, as the unit calls them, divide by pre then post."""
    results = rank_pool.run(_rank_halves, 4, 3)
    total = torch.stack([_values(r, 6) / 2 for r in range(4)]).sum(0) / 4
    for rank, result in enumerate(results):
        shard_rank = rank % 2
        assert result["same"] is True
        assert torch.equal(result["output"], total[shard_rank * 3 : (shard_rank + 1) * 3])
        assert result["factors"] == (2.0, 1.0, 4.0)
        assert result["calls"] == (1, 1)


def _rank_each_collective_divides(numel: int) -> dict[str, Any]:
    rank = dist.get_rank()
    mesh = sc.build_mesh((2, 2))
    shard_group, replicate_group = sc.mesh_groups(mesh)
    reducer = sc.DefaultGradReducer(
        shard_group,
        replicate_group=replicate_group,
        op="sum",
        post_divide=3.0,
        replicas_post_divide=5.0,
    )
    output = torch.empty(numel)
    result, work = reducer.scatter(_values(rank, numel * 2), output, async_op=True)
    work.wait()
    scattered = result.clone()
    reducer.all_reduce_replicas(result)
    return {
        "scattered": scattered,
        "output": result,
        "factors": (reducer.scatter_post_divide, reducer.replicas_divide, reducer.post_divide),
    }


def test_replicas_post_divide_divides_after_each_collective(rank_pool: Any) -> None:
    """With replicas_post_divide the reduce-scatter's result is divided before the all-reduce."""
    results = rank_pool.run(_rank_each_collective_divides, 4, 3)
    values = [_values(r, 6) for r in range(4)]
    # ranks (0, 1) and (2, 3) are shard groups; (0, 2) and (1, 3) replicate each other's rows
    scattered = [(values[0] + values[1]) / 3, (values[2] + values[3]) / 3]
    averaged = (scattered[0] + scattered[1]) / 5
    for rank, result in enumerate(results):
        rows = slice((rank % 2) * 3, (rank % 2 + 1) * 3)
        assert torch.equal(result["scattered"], scattered[rank // 2][rows])
        assert torch.equal(result["output"], averaged[rows])
        assert result["factors"] == (3.0, 5.0, 15.0)


def test_replicas_post_divide_needs_a_sum() -> None:
    """op='avg' picks its own factors, so a second one for the replicas is refused."""
    message = (
        "DefaultGradReducer(layers.0): replicas_post_divide must be a positive number with "
        "op='sum', got 2.0 with op='avg'"
    )
    with pytest.raises(CommError, match=f"^{re.escape(message)}$"):
        sc.DefaultGradReducer(label="layers.0", replicas_post_divide=2.0)


def _rank_scatter_without_output() -> str:
    try:
        sc.DefaultGradReducer().scatter(torch.zeros(4), None)
    except CommError as exc:
        return str(exc)
    return "no error"


def test_scatter_without_output_needs_a_custom_collective(rank_pool: Any) -> None:
    """Only a custom reduce-scatter allocates its own output; shard's needs one passed."""
    for message in rank_pool.run(_rank_scatter_without_output, 2):
        assert "output is None" in message


# ---------------------------------------------------------------------------
# Hooks
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("sharded", [True, False])
def test_a_hook_replaces_the_default_reduction(rank_pool: Any, sharded: bool) -> None:
    """A callable hook runs instead of the reducer: here the result is the bf16 reduction."""
    results = rank_pool.run(_rank_reduce, 2, 4, sharded, _bf16_hook)
    bf16 = [_values(r, 8).to(torch.bfloat16) for r in range(2)]
    expected = ((bf16[0] + bf16[1]) / 2).to(torch.float32)
    for rank, result in enumerate(results):
        want = expected[rank * 4 : (rank + 1) * 4] if sharded else expected
        assert torch.equal(result["result"], want)


def test_default_comm_hook_is_the_reducer() -> None:
    """default_comm_hook just calls reducer.reduce with the same tensors."""
    seen: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    class _Recorder:
        def reduce(self, grad: torch.Tensor, output: torch.Tensor | None) -> None:
            seen.append((grad, output))

    grad, output = torch.zeros(4), torch.zeros(2)
    sc.default_comm_hook(_Recorder(), grad, output)  # type: ignore[arg-type]
    assert len(seen) == 1
    assert seen[0][0] is grad
    assert seen[0][1] is output


def test_reduce_gradient_checks_sizes_before_the_hook() -> None:
    """A gradient that does not split evenly into the output is rejected, naming the sizes."""

    class _Two:
        world_size = 2

    message = (
        "reduce_gradient: grad has 5 elements but an output of 2 over 2 ranks needs 4; pad "
        "the flat gradient to a multiple of the world size"
    )
    with pytest.raises(sc.CommError, match=re.escape(message)):
        sc.reduce_gradient(torch.zeros(5), torch.zeros(2), _Two())  # type: ignore[arg-type]


class _LowpPlugin:
    @hookimpl
    def shard_comm_hooks(self) -> Mapping[str, CommHook]:
        return {"bf16_compress": _bf16_hook}


@pytest.fixture
def in_memory_registry(monkeypatch: pytest.MonkeyPatch) -> Registry:
    """A registry with one plugin registering 'bf16_compress', used by resolve_comm_hook."""
    pm = make_plugin_manager(load_entry_points=False)
    pm.register(_LowpPlugin(), name="lowp")
    registry = Registry(pm)
    monkeypatch.setattr(_hooks, "get_registry", lambda: registry)
    return registry


def test_resolve_comm_hook_by_name_or_callable(in_memory_registry: Registry) -> None:
    """A name resolves through the registry, a callable is itself, None means the default."""
    assert sc.resolve_comm_hook("bf16_compress") is _bf16_hook
    assert sc.resolve_comm_hook(sc.default_comm_hook) is sc.default_comm_hook
    assert sc.resolve_comm_hook(None) is None


def test_unknown_hook_name_lists_the_registered_names(in_memory_registry: Registry) -> None:
    """A misspelt name raises UnknownPluginNameError listing what is registered."""
    message = (
        "no comm hook is registered as 'bf16_compres'; registered: 'bf16_compress'. "
        "Did you mean 'bf16_compress'?"
    )
    with pytest.raises(UnknownPluginNameError, match=re.escape(message)):
        sc.resolve_comm_hook("bf16_compres")


def test_a_hook_that_is_not_callable_is_rejected() -> None:
    """Something neither a name nor a callable is a TypeError that says what to pass."""
    with pytest.raises(TypeError, match=re.escape("comm hook 3 is neither a registered hook")):
        sc.resolve_comm_hook(3)  # type: ignore[arg-type]


def _raising_hook(reducer: Any, grad: torch.Tensor, output: torch.Tensor | None) -> None:
    raise KeyError("oops in hook")


def test_a_hook_that_raises_is_named_with_its_unit() -> None:
    """An exception inside a comm hook names the hook, the unit and whose code raised it, and is
    still the exception's own category (``except KeyError`` catches it)."""

    class _Two:
        world_size = 2

    with pytest.raises(PluginCallError) as caught:
        sc.reduce_gradient(
            torch.zeros(4),
            torch.zeros(2),
            _Two(),  # type: ignore[arg-type]
            _raising_hook,
            unit="layers.3",
        )
    assert isinstance(caught.value, KeyError)
    assert isinstance(caught.value.__cause__, KeyError)
    assert str(caught.value).startswith(
        f"comm hook {__name__}._raising_hook raised KeyError: 'oops in hook' for unit 'layers.3'."
    )


def _failing_shard_hook(reducer: Any, grad: torch.Tensor, output: torch.Tensor | None) -> None:
    raise CommError("already names its culprit")


def test_a_shard_error_from_a_hook_passes_through() -> None:
    """A ShardError raised in a hook is not wrapped: it already says what is wrong."""

    class _Two:
        world_size = 2

    with pytest.raises(CommError, match=r"^already names its culprit$"):
        sc.reduce_gradient(torch.zeros(4), torch.zeros(2), _Two(), _failing_shard_hook)  # type: ignore[arg-type]
