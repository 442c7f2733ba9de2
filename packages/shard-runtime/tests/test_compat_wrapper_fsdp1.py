"""FullyShardedDataParallel side by side with PyTorch's, on what PyTorch's own FSDP1 tests pin.

PyTorch's FSDP1 test files (test_fsdp_apply, test_fsdp_clip_grad_norm,
test_wrap, test_fsdp_misc, test_fsdp_hybrid_shard, test_fsdp_grad_acc, ...)
check behaviours a user meets: ``apply()`` on nested wrappers, clipping
low-precision gradients, wrapping with an explicit (stand-in) process group,
refusing to auto-wrap around wrappers, the wrapper's ``training_state`` and
``_assert_state``. One rank function runs each under ``impl`` ("torch" or
"shard") on 2 ranks and returns plain values; each test compares one of them
and spot-checks PyTorch's answer, so that a comparison cannot pass vacuously.
PyTorch's wrapper runs on the CPU with ``device_id=torch.device("cpu")``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shard_testing import RankPool
from shard_testing.compat import Impl, fsdp_namespace


def _outcome(fn: Any) -> tuple[str, Any]:
    """``("ok", value)`` or ``(exception type, message)``: what ``fn()`` did."""
    try:
        return ("ok", fn())
    except Exception as exc:
        return (type(exc).__name__, str(exc))


def _kwargs(impl: Impl, **kwargs: Any) -> dict[str, Any]:
    if impl == "torch":
        kwargs.setdefault("device_id", torch.device("cpu"))
    return kwargs


def _nested(impl: Impl, **kwargs: Any) -> Any:
    """Linear 8->4, a unit holding a unit (4->16) and a Linear, a unit (16->4), Linear 4->8.

    Wrapped by hand, inner units first, the shape PyTorch's tests call
    NestedWrappedModule; the root unit holds the first and last Linear.
    """
    fsdp = fsdp_namespace(impl).FullyShardedDataParallel
    kwargs = _kwargs(impl, **kwargs)

    def wrap(module: nn.Module) -> nn.Module:
        wrapped: nn.Module = fsdp(module, **kwargs)
        return wrapped

    torch.manual_seed(0)
    inner = nn.Sequential(wrap(nn.Linear(4, 16)), nn.Linear(16, 16))
    model = nn.Sequential(nn.Linear(8, 4), wrap(inner), wrap(nn.Linear(16, 4)), nn.Linear(4, 8))
    return wrap(model)


def _input(step: int = 0) -> torch.Tensor:
    torch.manual_seed(1 + dist.get_rank() + 10 * step)
    return torch.rand(4, 8)


def _grad_sums(model: nn.Module) -> list[float | None]:
    return [None if p.grad is None else float(p.grad.sum()) for p in model.parameters()]


def _ones(module: nn.Module) -> None:
    if type(module) is nn.Linear:
        with torch.no_grad():
            module.weight.fill_(1.0)
            module.bias.fill_(1.0)


def _behaviours(impl: Impl) -> dict[str, Any]:
    warnings.simplefilter("ignore")  # the libraries word their warnings differently
    ns = fsdp_namespace(impl)
    fsdp = ns.FullyShardedDataParallel
    wrap_module = __import__(f"{ns.__name__}.wrap", fromlist=["wrap"])
    from torch.distributed.fsdp._common_utils import TrainingState as TorchTrainingState

    out: dict[str, Any] = {}

    # apply(): fn once per module, each wrapper gathering its own unit (test_fsdp_apply).
    model = _nested(impl)

    def apply_then_read() -> list[float]:
        model.apply(_ones)
        with fsdp.summon_full_params(model):
            return sorted({float(v) for p in model.parameters() for v in p.reshape(-1)})

    out["apply"] = _outcome(apply_then_read)

    def apply_inside_summon() -> None:
        with fsdp.summon_full_params(model):
            model.apply(_ones)

    out["apply_inside_summon"] = _outcome(apply_inside_summon)[0]

    # training_state and _assert_state, as PyTorch's shared test helpers use them.
    states: list[str] = [str(model.training_state)]
    with fsdp.summon_full_params(model):
        states.append(str(model.training_state))
    out["training_state"] = states
    out["assert_idle"] = _outcome(lambda: model._assert_state(TorchTrainingState.IDLE))
    out["assert_forward_backward"] = _outcome(
        lambda: model._assert_state([TorchTrainingState.FORWARD_BACKWARD])
    )[0]

    # rank, world_size, process_group (test_wrap's checks of the wrapper's attributes).
    out["group_attributes"] = (
        model.rank,
        model.world_size,
        model.process_group.size(),
        model.module[2].world_size,
    )

    # clip_grad_norm_ on an inner wrapper (test_fsdp_clip_grad_norm.test_non_root).
    model(_input()).sum().backward()
    out["clip_non_root"] = _outcome(lambda: model.module[2].clip_grad_norm_(1.0))[0]

    # Auto-wrapping around wrappers made by hand (test_wrap.test_error_already_wrapped).
    for nested in (False, True):
        inner = fsdp(nn.Linear(1, 1), **_kwargs(impl))
        holder = nn.Sequential(nn.Sequential(nn.Linear(1, 1), inner) if nested else inner)
        policy = wrap_module.size_based_auto_wrap_policy
        out[f"auto_wrap_around_wrapper_{nested}"] = _outcome(
            lambda holder=holder, policy=policy: fsdp(
                holder, auto_wrap_policy=policy, **_kwargs(impl)
            )
        )[0]
    return out


def _low_precision_clip(impl: Impl, strategy: str, dtype: str, norm_type: float) -> list[Any]:
    """keep_low_precision_grads, then clip_grad_norm_ (test_fsdp_clip_grad_norm's low precision)."""
    warnings.simplefilter("ignore")
    ns = fsdp_namespace(impl)
    out: list[Any] = []
    for orig in (False, True):
        low = getattr(torch, dtype)
        model = _nested(
            impl,
            sharding_strategy=ns.ShardingStrategy[strategy],
            use_orig_params=orig,
            mixed_precision=ns.MixedPrecision(
                param_dtype=low, reduce_dtype=low, keep_low_precision_grads=True
            ),
        )
        model(_input()).sum().backward()
        dtypes = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
        norm = model.clip_grad_norm_(1.0, norm_type)
        # With original parameters PyTorch shows the root unit's gradients unsharded on one
        # rank and not at all on the other when a parameter straddles the shard boundary
        # (3.weight here; any mixed precision): its flat gradient, and so the norm, is right.
        grads = _grad_sums(model) if not orig else None
        out.append((dtypes, str(norm.dtype), float(norm).hex(), grads))
    return out


def _training(impl: Impl, case: str) -> list[Any]:
    """Two steps of a configuration PyTorch's FSDP1 tests train; gradients and parameters."""
    warnings.simplefilter("ignore")
    ns = fsdp_namespace(impl)
    kwargs: dict[str, Any] = {}
    if case == "hybrid_zero2":
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["sharding_strategy"] = ns.ShardingStrategy._HYBRID_SHARD_ZERO2
        kwargs["device_mesh"] = init_device_mesh(
            "cpu", (1, 2), mesh_dim_names=("replicate", "shard")
        )
    elif case == "no_limit_forward_prefetch":
        kwargs.update(limit_all_gathers=False, forward_prefetch=True)
    elif case == "backward_post":
        kwargs.update(backward_prefetch=ns.BackwardPrefetch.BACKWARD_POST)
    elif case == "offload_no_sync" and impl == "shard":
        # PyTorch cannot offload on a CPU-only host (test_cpu_offload_without_an_accelerator);
        # offloading must not change a value, so shard offloaded meets PyTorch not offloaded.
        kwargs["cpu_offload"] = ns.CPUOffload(offload_params=True)
    model = _nested(impl, **kwargs)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    out: list[Any] = []
    for step in range(2):
        if case == "offload_no_sync":  # a micro-batch accumulated without communication
            with model.no_sync():
                model(_input(step + 5)).sum().backward()
            out.append(sorted({str(p.device) for p in model.parameters()}))
        model(_input(step)).sum().backward()
        out.append(_grad_sums(model))
        optim.step()
        optim.zero_grad()
    with ns.FullyShardedDataParallel.summon_full_params(model):
        out.append([p.tolist() for p in model.parameters()])
    return out


@pytest.fixture(scope="module")
def behaviours(rank_pool: RankPool) -> dict[str, list[dict[str, Any]]]:
    return {impl: rank_pool.run(_behaviours, 2, impl) for impl in ("torch", "shard")}


def test_apply_gathers_each_unit_once(behaviours: dict[str, list[dict[str, Any]]]) -> None:
    """apply(fn) on nested wrappers reaches every module with full parameters, as PyTorch's."""
    for theirs, ours in zip(behaviours["torch"], behaviours["shard"], strict=True):
        assert ours["apply"] == theirs["apply"] == ("ok", [1.0])


def test_apply_inside_summon_is_a_value_error(behaviours: dict[str, list[dict[str, Any]]]) -> None:
    """Inside summon_full_params, apply() raises PyTorch's ValueError."""
    for theirs, ours in zip(behaviours["torch"], behaviours["shard"], strict=True):
        assert ours["apply_inside_summon"] == theirs["apply_inside_summon"] == "ValueError"


def test_training_state_and_assert_state(behaviours: dict[str, list[dict[str, Any]]]) -> None:
    """training_state reads as PyTorch's; _assert_state takes PyTorch's TrainingState members,
    passes when the wrapper is in them and raises PyTorch's ValueError and words otherwise."""
    for theirs, ours in zip(behaviours["torch"], behaviours["shard"], strict=True):
        assert ours["training_state"] == theirs["training_state"]
        assert ours["assert_idle"] == theirs["assert_idle"] == ("ok", None)
        assert ours["assert_forward_backward"] == theirs["assert_forward_backward"]
    assert behaviours["torch"][0]["training_state"] == [
        "TrainingState.IDLE",
        "TrainingState.SUMMON_FULL_PARAMS",
    ]
    assert behaviours["torch"][0]["assert_forward_backward"] == "ValueError"


def test_rank_world_size_and_process_group(behaviours: dict[str, list[dict[str, Any]]]) -> None:
    """rank, world_size and process_group are PyTorch's attributes with PyTorch's values."""
    pairs = zip(behaviours["torch"], behaviours["shard"], strict=True)
    for rank, (theirs, ours) in enumerate(pairs):
        assert ours["group_attributes"] == theirs["group_attributes"] == (rank, 2, 2, 2)


def test_clip_grad_norm_on_an_inner_wrapper_is_refused(
    behaviours: dict[str, list[dict[str, Any]]],
) -> None:
    """clip_grad_norm_ on a non-root wrapper is PyTorch's RuntimeError."""
    for theirs, ours in zip(behaviours["torch"], behaviours["shard"], strict=True):
        assert ours["clip_non_root"] == theirs["clip_non_root"] == "RuntimeError"


@pytest.mark.parametrize("nested", [False, True])
def test_auto_wrap_around_a_wrapper_is_refused(
    behaviours: dict[str, list[dict[str, Any]]], nested: bool
) -> None:
    """An auto_wrap_policy over a model that holds a wrapper is PyTorch's ValueError."""
    key = f"auto_wrap_around_wrapper_{nested}"
    for theirs, ours in zip(behaviours["torch"], behaviours["shard"], strict=True):
        assert ours[key] == theirs[key] == "ValueError"


def _auto_wrap_message() -> str:
    from shard_runtime import FullyShardedDataParallel
    from shard_runtime.wrap import size_based_auto_wrap_policy

    holder = nn.Sequential(
        nn.Sequential(nn.Linear(1, 1), FullyShardedDataParallel(nn.Linear(1, 1)))
    )
    try:
        FullyShardedDataParallel(holder, auto_wrap_policy=size_based_auto_wrap_policy)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_auto_wrap_refusal_keeps_pytorchs_words(rank_pool: RankPool) -> None:
    """The message carries the words PyTorch's test matches, the culprit's name and the fix."""
    (message,) = rank_pool.run(_auto_wrap_message, 1)
    assert (
        "FSDP auto wrapping requires modules to not already have FSDP applied but found 0.1 in "
        "Sequential (a FullyShardedDataParallel)"
    ) in message
    assert "pass auto_wrap_policy=None" in message


@pytest.mark.parametrize(
    ("strategy", "dtype", "norm_type"),
    [
        ("FULL_SHARD", "float16", 2.0),
        ("FULL_SHARD", "bfloat16", float("inf")),
        ("NO_SHARD", "float16", 1.0),
        ("NO_SHARD", "bfloat16", 2.0),
    ],
)
def test_keep_low_precision_grads_clip_like_pytorch(
    rank_pool: RankPool, strategy: str, dtype: str, norm_type: float
) -> None:
    """fp16/bf16 gradients kept by keep_low_precision_grads on nested wrappers (flat and
    original parameters): the gradients' dtype, the norm's dtype and value and (flat
    parameters) the clipped gradients are PyTorch's bit for bit (NO_SHARD norms in the
    gradients' dtype, as torch.nn.utils.clip_grad_norm_ does)."""
    theirs = rank_pool.run(_low_precision_clip, 2, "torch", strategy, dtype, norm_type)
    ours = rank_pool.run(_low_precision_clip, 2, "shard", strategy, dtype, norm_type)
    assert ours == theirs
    for dtypes, norm_dtype, *_ in theirs[0]:
        assert dtypes == [f"torch.{dtype}"]
        assert norm_dtype == f"torch.{dtype}"


@pytest.mark.parametrize(
    "case", ["hybrid_zero2", "no_limit_forward_prefetch", "backward_post", "offload_no_sync"]
)
def test_training_matches_pytorch(rank_pool: RankPool, case: str) -> None:
    """_HYBRID_SHARD_ZERO2 on a (1, 2) mesh, limit_all_gathers=False with forward_prefetch,
    BACKWARD_POST, and no_sync accumulation with CPU offload (shard's; PyTorch's run keeps its
    parameters) train nested wrappers to PyTorch's gradients and parameters exactly."""
    theirs = rank_pool.run(_training, 2, "torch", case)
    ours = rank_pool.run(_training, 2, "shard", case)
    assert ours == theirs
    assert theirs[0] != theirs[1]  # the ranks saw different data


class _Done:
    def wait(self) -> bool:
        return True


class _StandInGroup:
    """A process group of one rank, as PyTorch's tests build one (not a ProcessGroup).

    PyTorch's one-rank NO_SHARD still all-reduces over it in backward, so it
    answers ``allreduce`` with finished work and leaves the tensors alone.
    """

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    def allreduce(self, tensors: list[torch.Tensor], options: object) -> _Done:
        return _Done()


def _stand_in_group_run(impl: Impl) -> dict[str, Any]:
    """Wrap, auto-wrap and train one step with an explicit group and no default group."""
    ns = fsdp_namespace(impl)
    wrap_module = __import__(f"{ns.__name__}.wrap", fromlist=["wrap"])
    group = _StandInGroup()
    torch.manual_seed(0)
    seq = nn.Sequential(
        nn.Linear(5, 5), nn.Linear(5, 5), nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5))
    )
    policy = wrap_module.ModuleWrapPolicy({nn.Sequential})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch: switching to NO_SHARD for one rank
        model = ns.FullyShardedDataParallel(
            seq, process_group=group, auto_wrap_policy=policy, **_kwargs(impl)
        )
    model(torch.ones(2, 5)).sum().backward()
    return {
        "types": [type(m).__name__ for m in model.module],
        "attributes": (model.rank, model.world_size, model.process_group is group),
        "grads": [p.grad.tolist() for p in model.parameters()],
    }


def test_explicit_group_without_a_default_group() -> None:
    """With no default process group, an explicit one-rank group (PyTorch's tests and fairseq
    pass a stand-in object) wraps, auto-wraps and trains as under PyTorch."""
    assert not dist.is_initialized()  # this test process has no default group
    theirs = _stand_in_group_run("torch")
    ours = _stand_in_group_run("shard")
    assert ours == theirs
    assert theirs["types"] == ["Linear", "Linear", "FullyShardedDataParallel"]
    assert theirs["attributes"] == (0, 1, True)


def _cpu_offload_forward(impl: Impl) -> tuple[str, Any]:
    ns = fsdp_namespace(impl)
    model = _nested(impl, cpu_offload=ns.CPUOffload(offload_params=True))
    return _outcome(lambda: tuple(model(_input()).shape))


def test_cpu_offload_without_an_accelerator(rank_pool: RankPool) -> None:
    """CPUOffload(offload_params=True) on a CPU-only host: PyTorch's first forward fails to
    reach an accelerator, shard's runs (a deliberate difference, in the compatibility table)."""
    theirs = rank_pool.run(_cpu_offload_forward, 2, "torch")
    ours = rank_pool.run(_cpu_offload_forward, 2, "shard")
    assert [kind for kind, _ in theirs] == ["RuntimeError"] * 2
    assert ours == [("ok", (4, 8))] * 2


def _without_device_id(impl: Impl) -> tuple[str, Any]:
    fsdp = fsdp_namespace(impl).FullyShardedDataParallel
    return _outcome(lambda: type(fsdp(nn.Linear(2, 2), process_group=_StandInGroup())).__name__)


def test_cpu_without_device_id() -> None:
    """On a CPU-only host without device_id, PyTorch's wrapper refuses and shard's wraps (a
    deliberate difference, in the compatibility table)."""
    assert _without_device_id("torch") == (
        "RuntimeError",
        "FSDP needs a non-CPU accelerator device, but no accelerator device is detected.",
    )
    assert _without_device_id("shard") == ("ok", "FullyShardedDataParallel")


class _Reorderable(nn.Module):
    """Two equal-sized units run in ``order``: all-gathers of either one pair up silently."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 6)
        self.blocks = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
        self.order = [0, 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for index in self.order:
            x = torch.relu(self.blocks[index](x))
        return x


def _execution_order(impl: Impl) -> dict[str, Any]:
    """TORCH_DISTRIBUTED_DEBUG=DETAIL (set_debug_level): the forward order checks."""
    fsdp = fsdp_namespace(impl).FullyShardedDataParallel
    previous = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)

    def build() -> nn.Module:
        torch.manual_seed(0)
        module = _Reorderable()
        for i in range(2):
            module.blocks[i] = fsdp(module.blocks[i], **_kwargs(impl))
        wrapped: nn.Module = fsdp(module, **_kwargs(impl))
        return wrapped

    def iterations(model: nn.Module, orders: list[list[int]], train: bool = True) -> list[Any]:
        seen = []
        for step, order in enumerate(orders):
            model.module.order = order
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if train:
                    model(_input(step)).sum().backward()
                else:
                    with torch.no_grad():
                        model(_input(step))
            seen.append([str(w.message) for w in caught if "order" in str(w.message)])
        return seen

    out: dict[str, Any] = {}
    try:
        swapped = [1, 0] if dist.get_rank() == 1 else [0, 1]
        out["ranks differ"] = _outcome(lambda: iterations(build(), [swapped]))
        out["all change later"] = iterations(build(), [[0, 1], [1, 0], [1, 0]])
        out["train then eval"] = iterations(build(), [[0, 1]] * 2) + iterations(
            build(), [[0, 1]] * 2, train=False
        )
    finally:
        dist.set_debug_level(previous)
    return out


def test_execution_order_checks_under_torch_distributed_debug_detail(rank_pool: RankPool) -> None:
    """With PyTorch's TORCH_DISTRIBUTED_DEBUG=DETAIL, as under PyTorch: a first iteration whose
    order differs across ranks raises RuntimeError on every rank (before the mismatched
    all-gather; PyTorch's test matches "^Forward order differs across ranks"), a later order
    change warns once per rank with the words PyTorch's test matches, and same-order training
    and eval iterations stay silent. shard names the units and the position; it runs the same
    check with SHARD_DEBUG=detail (and then for fully_shard too), and warns once where PyTorch
    warns at each changed position of that iteration."""
    theirs = rank_pool.run(_execution_order, 2, "torch")
    ours = rank_pool.run(_execution_order, 2, "shard")
    for rank, (their, our) in enumerate(zip(theirs, ours, strict=True)):
        assert their["ranks differ"][0] == our["ranks differ"][0] == "RuntimeError"
        for result in (their, our):
            assert result["ranks differ"][1].startswith("Forward order differs across ranks")
        assert "rank 0 runs 'blocks.0', rank 1 runs 'blocks.1'" in our["ranks differ"][1]
        for result in (their, our):
            first, changed, after = result["all change later"]
            assert (first, after) == ([], [])
            prefix = (
                f"Forward order differs from that of the first iteration on rank {rank}. "
                "Collectives are unchecked and may give incorrect results or hang"
            )
            assert changed
            assert all(message.startswith(prefix) for message in changed)
            assert result["train then eval"] == [[]] * 4
        assert len(our["all change later"][1]) == 1
