"""``shard_runtime.wrap`` side by side with ``torch.distributed.fsdp.wrap``.

Each rank function takes ``impl`` ("torch" or "shard"), imports the wrapper
and the wrap helpers from that library, runs the same user code and returns
plain values; the tests assert both libraries return the same. PyTorch's
wrapper runs on the CPU with ``device_id=torch.device("cpu")``.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.fsdp.wrap as torch_wrap
from torch import nn

import shard_runtime
import shard_runtime.wrap as shard_wrap
from shard_testing import RankPool


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 6)
        self.down = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    """Blocks (58 parameters: up 30, down 28), an attention layer (80), two small linears."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(3, 4)
        self.blocks = nn.Sequential(Block(), Block())
        self.attn = nn.MultiheadAttention(4, 2)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.inp(x))
        return self.out(self.attn(h, h, h, need_weights=False)[0])


def _api(impl: str) -> tuple[Any, Any, dict[str, Any]]:
    """(wrapper class, wrap module, the wrapper's extra keyword arguments) of ``impl``."""
    if impl == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel, torch_wrap, {"device_id": torch.device("cpu")}
    return shard_runtime.FullyShardedDataParallel, shard_wrap, {}


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").removesuffix("_fsdp_wrapped_module")


def _wrapped(model: nn.Module, cls: type) -> list[str]:
    return [_clean(n).rstrip(".") for n, m in model.named_modules() if isinstance(m, cls)]


def _policies(w: Any) -> dict[str, Any]:
    """The same policies, built from ``w`` (one library's wrap module)."""
    return {
        "always": w.always_wrap_policy,
        "lambda": functools.partial(
            w.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, Block)
        ),
        "transformer": functools.partial(
            w.transformer_auto_wrap_policy, transformer_layer_cls={Block}
        ),
        # 60: only the two blocks together; 30: each block's up, then the rest of both blocks.
        "size_60": functools.partial(w.size_based_auto_wrap_policy, min_num_params=60),
        "size_30": functools.partial(w.size_based_auto_wrap_policy, min_num_params=30),
        "size_30_no_leaves": functools.partial(
            w.size_based_auto_wrap_policy, min_num_params=30, force_leaf_modules=set()
        ),
        "size_30_exclude_sequential": functools.partial(
            w.size_based_auto_wrap_policy, min_num_params=30, exclude_wrap_modules={nn.Sequential}
        ),
        "size_default": w.size_based_auto_wrap_policy,
        "module_wrap_policy": w.ModuleWrapPolicy({Block, nn.MultiheadAttention}),
        "custom_policy": w.CustomPolicy(lambda m: isinstance(m, nn.Linear)),
    }


POLICIES = list(_policies(torch_wrap))


def _auto_wrap_structures(impl: str) -> dict[str, Any]:
    wrapper, w, kwargs = _api(impl)
    out: dict[str, Any] = {}
    for key, policy in _policies(w).items():
        model = wrapper(Net(), auto_wrap_policy=policy, **kwargs)
        out[key] = _wrapped(model, wrapper)
    return out


def _fully_shard_structures() -> dict[str, Any]:
    """Shard's policies through apply_wrap_policy: the modules fully_shard was applied to."""
    out: dict[str, Any] = {}
    for key, policy in _policies(shard_wrap).items():
        model = shard_runtime.apply_wrap_policy(Net(), policy)
        out[key] = [n for n, m in model.named_modules() if isinstance(m, shard_runtime.FSDPModule)]
    return out


@pytest.fixture(scope="module")
def structures(rank_pool: RankPool) -> dict[str, Any]:
    return {
        "torch": rank_pool.run(_auto_wrap_structures, 2, "torch")[0],
        "shard": rank_pool.run(_auto_wrap_structures, 2, "shard")[0],
        "fully_shard": rank_pool.run(_fully_shard_structures, 2)[0],
    }


@pytest.mark.parametrize("policy", POLICIES)
def test_each_policy_wraps_the_modules_pytorch_wraps(
    structures: dict[str, Any], policy: str
) -> None:
    """The same model under the same policy gives the same wrapped module names in both."""
    assert structures["shard"][policy] == structures["torch"][policy]


def test_policies_choose_what_their_options_say(structures: dict[str, Any]) -> None:
    """Spot checks of PyTorch's answers, so that the comparison cannot pass vacuously."""
    torch_names = structures["torch"]
    assert torch_names["transformer"] == ["", "blocks.0", "blocks.1"]
    assert torch_names["size_60"] == ["", "blocks"]
    # Attention (80 parameters) is a forced leaf: neither entered nor wrapped.
    assert torch_names["size_30"] == ["", "blocks", "blocks.0.up", "blocks.1.up"]
    assert torch_names["size_30_no_leaves"] == ["", "blocks", "blocks.0.up", "blocks.1.up", "attn"]
    assert torch_names["size_30_exclude_sequential"] == ["", "blocks.0.up", "blocks.1.up"]
    assert torch_names["size_default"] == [""]  # 1e8 parameters by default
    assert torch_names["module_wrap_policy"] == ["", "blocks.0", "blocks.1", "attn"]
    assert len(torch_names["always"]) == 12
    assert "attn.out_proj" in torch_names["always"]


@pytest.mark.parametrize("policy", POLICIES)
def test_policies_apply_through_fully_shard_as_units(
    structures: dict[str, Any], policy: str
) -> None:
    """apply_wrap_policy with the same policy shards exactly the modules PyTorch's wrapper wraps."""
    assert structures["fully_shard"][policy] == structures["torch"][policy]


class ListNet(nn.Module):
    """Blocks in an ``nn.ModuleList``, as most transformers hold their layers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(3, 4)
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for index in range(2):
            x = self.layers[index](x)
        return x


def _always_wrap_list(impl: str) -> dict[str, Any]:
    wrapper, w, kwargs = _api(impl)
    with warnings.catch_warnings():  # PyTorch: "FSDP will not all-gather ... containers"
        warnings.filterwarnings("ignore", "FSDP will not all-gather parameters for containers")
        model = wrapper(ListNet(), auto_wrap_policy=w.always_wrap_policy, **kwargs)
    with torch.no_grad():
        output = model(torch.arange(6.0).reshape(2, 3)).tolist()
    return {"wrapped": _wrapped(model, wrapper), "output": output}


def test_always_wrap_leaves_an_emptied_module_list_unwrapped(rank_pool: RankPool) -> None:
    """always_wrap_policy over a ModuleList: the same units and outputs as PyTorch, except that
    PyTorch also wraps the emptied list itself (shard's units need a forward)."""
    theirs = rank_pool.run(_always_wrap_list, 2, "torch")[0]
    ours = rank_pool.run(_always_wrap_list, 2, "shard")[0]
    assert ours["output"] == theirs["output"]
    assert "layers" in theirs["wrapped"]
    assert ours["wrapped"] == [n for n in theirs["wrapped"] if n != "layers"]
    assert len(ours["wrapped"]) == 8


# ---------------------------------------------------------------------- manual wrapping


class ManualNet(nn.Module):
    """Wraps its own blocks as it builds them (a no-op outside ``enable_wrap``)."""

    def __init__(self, w: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(3, 4)
        self.block = w.wrap(Block())
        self.tail = w.wrap(Block(), forward_prefetch=True)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.tail(self.block(self.inp(x))))


def _manual(impl: str) -> dict[str, Any]:
    wrapper, w, kwargs = _api(impl)
    plain = ManualNet(w)
    unwrapped = [type(m).__name__ for m in plain.children()]
    before_block = w.wrap(plain) is plain
    with w.enable_wrap(wrapper_cls=wrapper, **kwargs):
        model = w.wrap(ManualNet(w))
        try:
            with w.enable_wrap(wrapper_cls=wrapper):
                nested = "no error"
        except Exception as exc:
            nested = type(exc).__name__
    x = torch.arange(6.0).reshape(2, 3)
    return {
        "outside": unwrapped,
        "before_block": before_block,
        "wrapped": _wrapped(model, wrapper),
        "forward_prefetch": [m.forward_prefetch for m in model.modules() if isinstance(m, wrapper)],
        "nested": nested,
        "output": model(x).tolist(),
        "after_block": w.wrap(plain) is plain,
    }


def test_enable_wrap_and_wrap_build_pytorch_structure(rank_pool: RankPool) -> None:
    """enable_wrap + wrap make the same wrappers (with per-call overrides) and outputs as
    PyTorch; outside the block wrap is the identity; blocks do not nest (NotImplementedError)."""
    theirs = rank_pool.run(_manual, 2, "torch")
    ours = rank_pool.run(_manual, 2, "shard")
    assert ours == theirs
    assert theirs[0]["wrapped"] == ["", "block", "tail"]
    assert theirs[0]["forward_prefetch"] == [False, False, True]
    assert theirs[0]["outside"] == ["Linear", "Block", "Block", "Linear"]
    assert theirs[0]["nested"] == "NotImplementedError"
    assert theirs[0]["before_block"] is True
    assert theirs[0]["after_block"] is True


# ---------------------------------------------------------------------- the module's surface


def _shape(fn: Any) -> list[tuple[str, str, object]]:
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_wrap_module_has_pytorch_public_names_and_signatures() -> None:
    """shard_runtime.wrap exports torch.distributed.fsdp.wrap's __all__, each name with
    PyTorch's parameter names, kinds and defaults."""
    assert sorted(shard_wrap.__all__) == sorted(torch_wrap.__all__)
    public = {n for n in dir(torch_wrap) if not n.startswith("_")} & set(torch_wrap.__all__)
    assert public <= set(dir(shard_wrap))
    for name in torch_wrap.__all__:
        assert _shape(getattr(shard_wrap, name)) == _shape(getattr(torch_wrap, name)), name
    assert inspect.isfunction(shard_wrap.wrap)


def test_size_based_policy_class_attributes_and_defaults_match() -> None:
    """FORCE_LEAF_MODULES and EXCLUDE_WRAP_MODULES exist with PyTorch's values; the default
    threshold is 1e8 parameters."""
    ours = vars(shard_wrap.size_based_auto_wrap_policy)
    theirs = vars(torch_wrap.size_based_auto_wrap_policy)
    assert ours["FORCE_LEAF_MODULES"] == theirs["FORCE_LEAF_MODULES"]
    assert ours["FORCE_LEAF_MODULES"] == {nn.MultiheadAttention}
    assert ours["EXCLUDE_WRAP_MODULES"] == theirs["EXCLUDE_WRAP_MODULES"]
    assert ours["EXCLUDE_WRAP_MODULES"] == {nn.ModuleList, nn.ModuleDict}
    signature = inspect.signature(shard_wrap.size_based_auto_wrap_policy)
    assert signature.parameters["min_num_params"].default == 100_000_000


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((nn.Linear(2, 2), True, 10), True),
        ((nn.Linear(2, 2), True, 9), False),
        ((nn.Linear(2, 2), False, 10), True),
        ((nn.MultiheadAttention(4, 2), True, 10), False),
        ((nn.MultiheadAttention(4, 2), False, 10), True),
        ((nn.ModuleList(), True, 10), True),
        ((nn.ModuleList(), False, 10), False),
    ],
)
def test_size_based_policy_answers_as_pytorch(
    args: tuple[nn.Module, bool, int], expected: bool
) -> None:
    """size_based_auto_wrap_policy(min_num_params=10) answers every (module, recurse) as PyTorch."""
    ours = shard_wrap.size_based_auto_wrap_policy(*args, min_num_params=10)
    theirs = torch_wrap.size_based_auto_wrap_policy(*args, min_num_params=10)
    assert ours is theirs is expected


def test_helpers_are_exported_from_shard_runtime() -> None:
    """The policy functions and enable_wrap are top-level names of shard_runtime too (wrap
    itself only in shard_runtime.wrap, as in PyTorch, where fsdp.wrap is the module)."""
    for name in (
        "always_wrap_policy",
        "enable_wrap",
        "lambda_auto_wrap_policy",
        "size_based_auto_wrap_policy",
        "transformer_auto_wrap_policy",
    ):
        assert name in shard_runtime.__all__
        assert getattr(shard_runtime, name) is getattr(shard_wrap, name)


@pytest.mark.parametrize("keywords", [False, True])
def test_module_wrap_policy_is_callable_as_pytorch(keywords: bool) -> None:
    """ModuleWrapPolicy(...)(module, recurse, nonwrapped_numel) answers every (module, recurse)
    as PyTorch's, positionally or by keyword; CustomPolicy is callable where PyTorch's is."""
    ours = shard_wrap.ModuleWrapPolicy({Block})
    theirs = torch_wrap.ModuleWrapPolicy({Block})
    for module in (Block(), nn.Linear(2, 2), nn.Sequential()):
        for recurse in (True, False):
            if keywords:
                args: dict[str, Any] = {"module": module, "recurse": recurse, "nonwrapped_numel": 7}
                assert ours(**args) is theirs(**args)
            else:
                assert ours(module, recurse, 7) is theirs(module, recurse, 7)
    assert callable(shard_wrap.CustomPolicy(bool)) == callable(torch_wrap.CustomPolicy(bool))


def _or_policy_structure(impl: str) -> list[str]:
    """PyTorch's _or_policy over a ModuleWrapPolicy and a policy function of ``impl``."""
    wrapper, w, kwargs = _api(impl)
    first_linear = functools.partial(
        w.lambda_auto_wrap_policy,
        lambda_fn=lambda m: isinstance(m, nn.Linear) and m.in_features == 3,
    )
    policy = functools.partial(
        torch_wrap._or_policy, policies=[w.ModuleWrapPolicy({Block}), first_linear]
    )
    return _wrapped(wrapper(Net(), auto_wrap_policy=policy, **kwargs), wrapper)


def test_module_wrap_policy_composes_like_a_policy_function(rank_pool: RankPool) -> None:
    """A ModuleWrapPolicy inside PyTorch's _or_policy wraps the modules PyTorch wraps."""
    theirs = rank_pool.run(_or_policy_structure, 2, "torch")[0]
    ours = rank_pool.run(_or_policy_structure, 2, "shard")[0]
    assert ours == theirs
    assert theirs == ["", "inp", "blocks.0", "blocks.1"]
