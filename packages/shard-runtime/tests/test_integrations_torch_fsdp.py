"""use_shard_for_torch_fsdp: PyTorch's FSDP names resolve to shard's, and come back exactly."""

from __future__ import annotations

import subprocess
import sys
import types
from collections.abc import Iterator

import pytest
import torch.distributed._composable.fsdp as torch_composable_fsdp
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp.wrap as torch_wrap

import shard_runtime
import shard_runtime.wrap
from shard_runtime.integrations import (
    KNOWN_FRAMEWORKS,
    TORCH_FSDP_MODULES,
    LateBindingError,
    LateBindingWarning,
    use_shard_for_torch_fsdp,
)
from shard_runtime.integrations import torch_fsdp as integration

# PyTorch's objects, kept in a dict (not as module attributes, which the
# integration would report as late bindings).
TORCH = {name: getattr(torch_fsdp, name) for name in torch_fsdp.__all__}
TORCH_WRAP = {name: getattr(torch_wrap, name) for name in torch_wrap.__all__}
FAKE_USER = "fake_user_code.train"  # outside torch, shard_* and the known frameworks


def _snapshot() -> dict[str, dict[str, int]]:
    """id of every attribute of every rebound namespace."""
    return {
        name: {attr: id(value) for attr, value in vars(sys.modules[name]).items()}
        for name in TORCH_FSDP_MODULES
    }


@pytest.fixture(autouse=True)
def _no_leak() -> Iterator[None]:
    yield
    assert integration._PATCH.count == 0, "a test left the patch active"
    assert torch_fsdp.fully_shard is TORCH["fully_shard"]


@pytest.fixture
def fake_module() -> Iterator[types.ModuleType]:
    """A user module that bound PyTorch's fully_shard and FSDP1 class (aliased) at import."""
    module = types.ModuleType(FAKE_USER)
    vars(module).update(fully_shard=TORCH["fully_shard"], FSDP=TORCH["FullyShardedDataParallel"])
    sys.modules[FAKE_USER] = module
    yield module
    del sys.modules[FAKE_USER]


def test_every_public_name_resolves_to_shard() -> None:
    """Every name of torch.distributed.fsdp's and .wrap's __all__ is shard's object while active."""
    with use_shard_for_torch_fsdp(late_bindings="ignore"):
        for name in torch_fsdp.__all__:
            assert getattr(torch_fsdp, name) is getattr(shard_runtime, name), name
        for name in torch_wrap.__all__:
            assert getattr(torch_wrap, name) is getattr(shard_runtime.wrap, name), name
        from torch.distributed._composable.fsdp import FSDPModule, fully_shard
        from torch.distributed._composable.fsdp.fully_shard import FSDPModule as deep_fsdp_module
        from torch.distributed.fsdp.fully_sharded_data_parallel import (
            FullyShardedDataParallel,
            ShardingStrategy,
            StateDictType,
        )

        assert FSDPModule is deep_fsdp_module is shard_runtime.FSDPModule
        assert fully_shard is shard_runtime.fully_shard
        assert FullyShardedDataParallel is shard_runtime.FullyShardedDataParallel
        assert ShardingStrategy is shard_runtime.ShardingStrategy
        assert StateDictType is shard_runtime.StateDictType
    assert torch_composable_fsdp.FSDPModule is TORCH["FSDPModule"]
    assert torch_wrap.ModuleWrapPolicy is TORCH_WRAP["ModuleWrapPolicy"]


def test_undo_restores_exactly() -> None:
    """After undo every attribute of every rebound namespace is the object it was before."""
    before = _snapshot()
    patch = use_shard_for_torch_fsdp(late_bindings="ignore")
    assert patch.active
    assert "torch.distributed.fsdp.fully_shard" in patch.patched
    assert "torch.distributed._composable.fsdp.fully_shard.FSDPModule" in patch.patched
    assert _snapshot() != before
    patch.undo()
    assert not patch.active
    assert patch.patched == ()
    assert _snapshot() == before


def test_idempotent_and_reference_counted() -> None:
    """A second call rebinds nothing more; names stay shard's until the last handle is undone."""
    before = _snapshot()
    first = use_shard_for_torch_fsdp(late_bindings="ignore")
    patched = first.patched
    second = use_shard_for_torch_fsdp(late_bindings="ignore")
    assert second.patched == patched
    first.undo()
    first.undo()  # a handle releases once
    assert torch_fsdp.FSDPModule is shard_runtime.FSDPModule
    second.undo()
    assert _snapshot() == before


def test_context_manager_restores_on_error() -> None:
    """The with block rebinds, and restores even when its body raises."""
    before = _snapshot()

    def body() -> None:
        with use_shard_for_torch_fsdp(late_bindings="ignore") as patch:
            assert patch.active
            assert torch_fsdp.fully_shard is shard_runtime.fully_shard
            raise KeyError("boom")

    with pytest.raises(KeyError):
        body()
    assert _snapshot() == before


def test_known_framework_bindings_rebound_both_ways() -> None:
    """A known framework's import-time bindings (any alias) follow the patch, before or after."""
    name = f"{KNOWN_FRAMEWORKS[0]}._shard_test_parallelize"
    imported_before = types.ModuleType(name)
    vars(imported_before).update(FSDPModule=TORCH["FSDPModule"], shard=TORCH["fully_shard"])
    sys.modules[name] = imported_before
    try:
        with use_shard_for_torch_fsdp(late_bindings="ignore") as patch:
            assert imported_before.FSDPModule is shard_runtime.FSDPModule
            assert imported_before.shard is shard_runtime.fully_shard
            assert f"{name}.FSDPModule" in patch.patched
            # Imported while active: it binds shard's through the rebound namespace.
            imported_during = types.ModuleType(f"{name}_later")
            sys.modules[imported_during.__name__] = imported_during
            exec(  # the import statement a framework module runs at its top
                "from torch.distributed.fsdp import MixedPrecisionPolicy",
                vars(imported_during),
            )
            assert imported_during.MixedPrecisionPolicy is shard_runtime.MixedPrecisionPolicy
        assert imported_before.FSDPModule is TORCH["FSDPModule"]
        assert imported_before.shard is TORCH["fully_shard"]
        assert imported_during.MixedPrecisionPolicy is TORCH["MixedPrecisionPolicy"]
    finally:
        sys.modules.pop(name)
        sys.modules.pop(f"{name}_later", None)


def test_late_binding_raises_naming_module_and_attribute(fake_module: types.ModuleType) -> None:
    """By default a user module holding PyTorch's objects is an error, and nothing is rebound."""
    with pytest.raises(LateBindingError) as raised:
        use_shard_for_torch_fsdp()
    message = str(raised.value)
    assert message.startswith(
        "use_shard_for_torch_fsdp: these modules bound PyTorch's FSDP objects at import time "
        "and would keep using them instead of shard's: "
    )
    assert f"{FAKE_USER}.fully_shard (PyTorch's fully_shard)" in message
    assert f"{FAKE_USER}.FSDP (PyTorch's FullyShardedDataParallel)" in message
    assert message.endswith(
        ". Fix: call use_shard_for_torch_fsdp() before importing them, read the names "
        "through the module (torch.distributed.fsdp.fully_shard) when they are used, or pass "
        "patch_modules=(...) naming them to rebind them too; late_bindings='ignore' when they "
        "hold PyTorch's FSDP on purpose"
    )
    assert torch_fsdp.fully_shard is TORCH["fully_shard"]
    assert integration._PATCH.bindings == {}


def test_late_binding_warns(fake_module: types.ModuleType) -> None:
    """late_bindings="warn" names the module, then rebinds PyTorch's namespaces (not the module)."""
    expected = rf"{FAKE_USER}\.fully_shard \(PyTorch's fully_shard\)"
    with pytest.warns(LateBindingWarning, match=expected):
        patch = use_shard_for_torch_fsdp(late_bindings="warn")
    with patch:
        assert torch_fsdp.fully_shard is shard_runtime.fully_shard
        assert fake_module.fully_shard is TORCH["fully_shard"]


def test_patch_modules_rebinds_named_module(fake_module: types.ModuleType) -> None:
    """A module named in patch_modules is rebound like a known framework, and restored."""
    with use_shard_for_torch_fsdp(late_bindings="ignore", patch_modules=[FAKE_USER]) as patch:
        assert fake_module.fully_shard is shard_runtime.fully_shard
        assert fake_module.FSDP is shard_runtime.FullyShardedDataParallel
        assert f"{FAKE_USER}.FSDP" in patch.patched
    assert fake_module.fully_shard is TORCH["fully_shard"]
    assert fake_module.FSDP is TORCH["FullyShardedDataParallel"]


def test_binding_changed_while_active_is_left_alone() -> None:
    """Undo puts PyTorch's object back only where shard's is still bound."""

    def replacement() -> None: ...

    try:
        with use_shard_for_torch_fsdp(late_bindings="ignore"):
            torch_fsdp.fully_shard = replacement  # type: ignore[assignment]
        assert torch_fsdp.fully_shard is replacement
        assert torch_fsdp.FSDPModule is TORCH["FSDPModule"]
    finally:
        torch_fsdp.fully_shard = TORCH["fully_shard"]


def test_bad_arguments() -> None:
    """An unknown late_bindings value or a module that is not imported is refused up front."""
    with pytest.raises(
        ValueError, match=r"^late_bindings='raise': expected 'error', 'warn' or 'ignore'$"
    ):
        use_shard_for_torch_fsdp(late_bindings="raise")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=r"^patch_modules names modules that are not imported: no_such_module_xyz; "
        r"import them first \(modules imported later read the rebound names by themselves\)$",
    ):
        use_shard_for_torch_fsdp(patch_modules=["no_such_module_xyz"])


def test_importing_shard_runtime_leaves_torch_fsdp_unimported() -> None:
    """``import shard_runtime`` exports the integration without importing torch.distributed.fsdp."""
    code = (
        "import sys, shard_runtime; "
        "print(callable(shard_runtime.use_shard_for_torch_fsdp), "
        "'torch.distributed.fsdp' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    # "True True": something shard_runtime imports now imports torch.distributed.fsdp.
    assert result.stdout.split() == ["True", "False"]


_PIPELINING_BINDINGS = """
import torch.distributed.fsdp as torch_fsdp
import shard_runtime
from shard_runtime.integrations import use_shard_for_torch_fsdp
names = ("FSDPModule", "fully_shard", "UnshardHandle")
torch_objects = [getattr(torch_fsdp, n) for n in names]
def bound():
    import torch.distributed.pipelining.schedules as schedules
    import torch.distributed.pipelining.stage as stage
    where = ((stage, "FSDPModule"), (stage, "fully_shard"), (schedules, "UnshardHandle"))
    return [vars(module).get(n) for module, n in where]
if {before}:
    bound()
patch = use_shard_for_torch_fsdp(late_bindings="ignore")
during = bound()
patch.undo()
after = bound()
print(during == [getattr(shard_runtime, n) for n in names], after == torch_objects)
"""


@pytest.mark.parametrize("before", [True, False], ids=["imported_before", "imported_during"])
def test_pipelining_bindings_follow_the_patch(before: bool) -> None:
    """torch.distributed.pipelining's import-time FSDP names are shard's while the patch is on.

    Imported before the call they are rebound, imported during it they bind shard's through
    the rebound namespace; PyTorch's come back on undo either way (a fresh interpreter, so
    the import order is real).
    """
    code = _PIPELINING_BINDINGS.format(before=before)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.split() == ["True", "True"]
