"""Point PyTorch's public FSDP names at shard's, so that frameworks run on shard unchanged.

Most FSDP2 users never call ``fully_shard`` themselves: Lightning Fabric's
``ModelParallelStrategy``, torchtitan and Hugging Face accelerate do, and they
import ``fully_shard`` and ``FSDPModule`` from ``torch.distributed.fsdp`` (or
the older ``torch.distributed._composable.fsdp``) and check
``isinstance(module, FSDPModule)`` against that class. With shard's modules
such a check is ``False`` and the framework silently skips its step (Fabric's
``no_backward_sync``, torchtitan's ``set_gradient_divide_factor(1.0)``).
:func:`use_shard_for_torch_fsdp` rebinds those names to shard's counterparts::

    from shard_runtime.integrations import use_shard_for_torch_fsdp

    with use_shard_for_torch_fsdp():
        fabric = L.Fabric(strategy=ModelParallelStrategy(parallelize_fn=...))
        ...  # the framework's code, unchanged, now runs on shard

This module is the only product code of shard that imports
``torch.distributed.fsdp`` (the lint rule banning it is lifted for
``shard_runtime.integrations``): it must, to rebind PyTorch's names. Importing
``shard_runtime`` alone never imports it. See [Note: what is rebound].
"""

from __future__ import annotations

import importlib
import sys
import threading
import types
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "KNOWN_FRAMEWORKS",
    "LateBindingError",
    "LateBindingWarning",
    "TORCH_FSDP_CLIENTS",
    "TORCH_FSDP_MODULES",
    "TorchFSDPPatch",
    "integration_active",
    "use_shard_for_torch_fsdp",
]

# [Note: what is rebound]
# 1. PyTorch's public FSDP namespaces (TORCH_FSDP_MODULES): every attribute
#    that is one of PyTorch's public FSDP objects (the names of
#    torch.distributed.fsdp's and torch.distributed.fsdp.wrap's __all__) is
#    set to shard's object of the same name. A framework that imports lazily
#    (``from torch.distributed.fsdp import FSDPModule`` inside a function, as
#    Lightning and accelerate do) or imports after the call gets shard's.
#    torch.distributed._composable.fsdp.fully_shard is a module (the package
#    attribute of that name is the function); both are rebound.
# 2. Modules of known frameworks (KNOWN_FRAMEWORKS) that bound one of those
#    objects at import time, under any name (torchtitan's
#    ``models/llama3/infra/parallelize.py`` and ``components/ft/manager.py``
#    import FSDPModule and fully_shard at the top; transformers'
#    ``distributed/fsdp.py`` imports fully_shard and the policies when torch
#    distributed is available): rebound the same way, so calling before or
#    after importing the framework is the same.
# 3. Any other module that bound one of those objects at import time (user
#    code, another library) cannot be rebound safely: it may hold PyTorch's
#    FSDP on purpose, as a reference. It is reported, naming the module and
#    the attribute (late_bindings="error", the default, raises
#    LateBindingError; "warn" warns; "ignore" does nothing), or rebound when
#    named in patch_modules.
# 4. torch's own modules that drive FSDP through names bound at import
#    (TORCH_FSDP_CLIENTS: torch.distributed.pipelining's stage and schedules
#    check isinstance(submod, FSDPModule) and call fully_shard.state(submod);
#    see _torch_state_view.py): rebound the same way as known frameworks.
# Never rebound: torch's other modules outside the namespaces in 1 (e.g.
# torch.distributed.checkpoint.state_dict binds PyTorch's classes at import
# and keeps them; shard's modules take its generic DTensor paths), the
# private modules that define PyTorch's
# FSDP2 (torch.distributed.fsdp._fully_shard._fully_shard and friends, so
# that PyTorch's own code keeps working) and shard's own packages. Bindings
# that are not module attributes (default arguments, closures, class
# attributes, values copied into containers) cannot be found at all.
# While active, PyTorch's FSDP1 class must not be used: its defining module,
# torch.distributed.fsdp.fully_sharded_data_parallel, is one of the rebound
# namespaces (Lightning and accelerate import from it).
#
# The patch is reference counted: the first call records PyTorch's objects
# and rebinds; later calls rebind what appeared since (a framework imported
# in between); each handle's undo() releases once, and the last release puts
# back PyTorch's objects wherever shard's are still bound (a binding someone
# changed since is left alone). Known framework modules imported while active
# bound shard's objects through the rebound namespaces; they get PyTorch's
# back too.

#: PyTorch's public FSDP namespaces whose attributes are rebound.
TORCH_FSDP_MODULES: tuple[str, ...] = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp.api",
    "torch.distributed.fsdp.fully_sharded_data_parallel",
    "torch.distributed.fsdp.wrap",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
)

#: Top-level packages whose modules are rebound too (step 2 of [Note: what is rebound]).
KNOWN_FRAMEWORKS: tuple[str, ...] = (
    "torchtitan",
    "lightning",
    "lightning_fabric",
    "pytorch_lightning",
    "accelerate",
    "transformers",
)

#: torch's own modules that drive FSDP through names bound at import (step 4 of the note).
TORCH_FSDP_CLIENTS: tuple[str, ...] = (
    "torch.distributed.pipelining.stage",
    "torch.distributed.pipelining.schedules",
)

# Top-level packages never scanned: torch's own (see the note) and shard's.
_NEVER_SCANNED = ("torch", "torchgen", "functorch")

LateBindings = Literal["error", "warn", "ignore"]


class LateBindingError(RuntimeError):
    """A module bound PyTorch's FSDP objects at import time; it would keep using them."""


class LateBindingWarning(UserWarning):
    """A module bound PyTorch's FSDP objects at import time; it keeps using them."""


@dataclass(frozen=True)
class _Binding:
    """One rebound module attribute."""

    module: types.ModuleType
    attr: str
    original: object  # PyTorch's object, put back by the last undo
    replacement: object  # shard's object


class _Patch:
    """The process-wide patch: PyTorch's objects, shard's, and every binding changed."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.count = 0
        # id(PyTorch's object) -> (PyTorch's object, shard's object, public name)
        self.to_shard: dict[int, tuple[object, object, str]] = {}
        self.to_torch: dict[int, object] = {}  # id(shard's object) -> PyTorch's object
        self.bindings: dict[tuple[str, str], _Binding] = {}

    def load_objects(self) -> None:
        """Import PyTorch's namespaces and shard's counterparts; pair them by public name."""
        import shard_runtime
        import shard_runtime.wrap

        for module_name in TORCH_FSDP_MODULES:
            importlib.import_module(module_name)
        torch_fsdp = sys.modules["torch.distributed.fsdp"]
        torch_wrap = sys.modules["torch.distributed.fsdp.wrap"]
        # PyTorch's public names, each paired with shard's object of the same name (all of
        # torch.distributed.fsdp's __all__ in torch 2.13; shard_runtime.wrap mirrors
        # torch.distributed.fsdp.wrap name for name).
        pairs = [(torch_fsdp, shard_runtime, n) for n in torch_fsdp.__all__]
        pairs += [(torch_wrap, shard_runtime.wrap, n) for n in shard_runtime.wrap.__all__]
        to_shard: dict[int, tuple[object, object, str]] = {}
        to_torch: dict[int, object] = {}
        for torch_module, shard_module, name in pairs:
            # A name another torch release lacks, or adds before shard has it (the compat
            # table's test names those), is simply not rebound.
            original = getattr(torch_module, name, None)
            replacement = getattr(shard_module, name, None)
            if original is None or replacement is None:
                continue
            to_shard[id(original)] = (original, replacement, name)
            to_torch[id(replacement)] = original
        self.to_shard, self.to_torch = to_shard, to_torch

    def rebind(self, module: types.ModuleType) -> None:
        """Set every attribute of ``module`` holding a PyTorch FSDP object to shard's."""
        for attr, value in list(vars(module).items()):
            entry = self.to_shard.get(id(value))
            if entry is None or entry[0] is not value:
                continue
            binding = _Binding(module, attr, value, entry[1])
            self.bindings.setdefault((module.__name__, attr), binding)
            setattr(module, attr, binding.replacement)

    def late_bindings(self, skip: set[str]) -> list[str]:
        """``module.attr (name)`` of modules outside ``skip`` that hold PyTorch's objects."""
        found = []
        seen: set[int] = set()  # a module listed twice (__main__ and __mp_main__) is named once
        for module_name, module in list(sys.modules.items()):
            if module_name in skip or _top(module_name) in _NEVER_SCANNED or id(module) in seen:
                continue
            seen.add(id(module))
            if _top(module_name).startswith("shard_") or _top(module_name) in KNOWN_FRAMEWORKS:
                continue
            for attr, value in _module_items(module):
                entry = self.to_shard.get(id(value))
                if entry is not None and entry[0] is value:
                    found.append(f"{module_name}.{attr} (PyTorch's {entry[2]})")
        return found

    def restore(self) -> None:
        """Put PyTorch's objects back wherever shard's are still bound."""
        for binding in self.bindings.values():
            if vars(binding.module).get(binding.attr) is binding.replacement:
                setattr(binding.module, binding.attr, binding.original)
        self.bindings.clear()
        for module in (*_framework_modules(), *_client_modules()):
            for attr, value in list(vars(module).items()):
                original = self.to_torch.get(id(value))
                if original is not None:
                    setattr(module, attr, original)


_PATCH = _Patch()


def integration_active() -> bool:
    """Whether PyTorch's FSDP names resolve to shard's now (from any handle)."""
    return _PATCH.count > 0


class TorchFSDPPatch:
    """Returned by :func:`use_shard_for_torch_fsdp`: undo it, or use it as a context manager.

    Each handle releases the patch once (a second ``undo()`` does nothing);
    PyTorch's objects come back when the last handle is released.
    """

    def __init__(self) -> None:
        self._released = False

    @property
    def active(self) -> bool:
        """Whether PyTorch's FSDP names currently resolve to shard's (from any handle)."""
        return integration_active()

    @property
    def patched(self) -> tuple[str, ...]:
        """``module.attr`` of every binding currently rebound, sorted."""
        with _PATCH.lock:
            return tuple(sorted(f"{m}.{a}" for m, a in _PATCH.bindings))

    def undo(self) -> None:
        """Release this handle; the last release restores PyTorch's objects exactly."""
        with _PATCH.lock:
            if self._released:
                return
            self._released = True
            _PATCH.count -= 1
            if _PATCH.count == 0:
                _PATCH.restore()

    def __enter__(self) -> TorchFSDPPatch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.undo()


def use_shard_for_torch_fsdp(
    *,
    late_bindings: LateBindings = "error",
    patch_modules: Iterable[str] = (),
) -> TorchFSDPPatch:
    """Make PyTorch's public FSDP names resolve to shard's, until undone.

    After the call, ``torch.distributed.fsdp.fully_shard``, ``.FSDPModule``,
    ``.MixedPrecisionPolicy``, ``.FullyShardedDataParallel``,
    ``.ShardingStrategy``, ... (every name of ``torch.distributed.fsdp``'s
    ``__all__``), ``torch.distributed.fsdp.wrap``'s policies and the same
    names under ``torch.distributed._composable.fsdp`` are shard's objects, so
    a framework's ``isinstance(m, FSDPModule)`` recognises shard's modules
    and its ``fully_shard(...)`` calls shard. Modules of the frameworks in
    :data:`KNOWN_FRAMEWORKS` that bound those names at import are rebound too;
    see [Note: what is rebound] for what is and is not reached.

    Safe to call before or after the framework is imported, and more than
    once (reference counted). Returns a handle whose ``undo()`` (or the end
    of its ``with`` block) releases it.

    Args:
        late_bindings: what to do when a module outside PyTorch, shard and
            the known frameworks already holds one of PyTorch's FSDP objects
            as an attribute (``from torch.distributed.fsdp import
            fully_shard`` at its top): it would keep calling PyTorch's.
            ``"error"`` raises :class:`LateBindingError` naming each
            ``module.attribute``, ``"warn"`` warns with
            :class:`LateBindingWarning`, ``"ignore"`` leaves it (for modules
            that hold PyTorch's FSDP on purpose, as a reference).
        patch_modules: names of further modules (imported already) to rebind
            the way known frameworks are, instead of reporting them.

    Raises:
        LateBindingError: with ``late_bindings="error"``, before anything is
            rebound.
        ValueError: ``late_bindings`` is not one of the three values, or a
            module of ``patch_modules`` is not imported.
    """
    if late_bindings not in ("error", "warn", "ignore"):
        raise ValueError(f"late_bindings={late_bindings!r}: expected 'error', 'warn' or 'ignore'")
    extra = tuple(patch_modules)
    missing = [name for name in extra if not isinstance(sys.modules.get(name), types.ModuleType)]
    if missing:
        raise ValueError(
            f"patch_modules names modules that are not imported: {', '.join(missing)}; "
            "import them first (modules imported later read the rebound names by themselves)"
        )
    with _PATCH.lock:
        if not _PATCH.to_shard:
            _PATCH.load_objects()
        found = _PATCH.late_bindings(set(extra)) if late_bindings != "ignore" else []
        if found:
            message = _late_binding_message(found)
            if late_bindings == "error":
                raise LateBindingError(message)
            warnings.warn(message, LateBindingWarning, stacklevel=2)
        for module_name in TORCH_FSDP_MODULES:
            _PATCH.rebind(sys.modules[module_name])
        for module in (*_framework_modules(), *_client_modules()):
            _PATCH.rebind(module)
        for module_name in extra:
            _PATCH.rebind(sys.modules[module_name])
        _PATCH.count += 1
    return TorchFSDPPatch()


def _late_binding_message(found: list[str]) -> str:
    return (
        "use_shard_for_torch_fsdp: these modules bound PyTorch's FSDP objects at import time "
        "and would keep using them instead of shard's: "
        + "; ".join(found)
        + ". Fix: call use_shard_for_torch_fsdp() before importing them, read the names "
        "through the module (torch.distributed.fsdp.fully_shard) when they are used, or pass "
        "patch_modules=(...) naming them to rebind them too; late_bindings='ignore' when they "
        "hold PyTorch's FSDP on purpose"
    )


def _top(module_name: str) -> str:
    return module_name.partition(".")[0]


def _framework_modules() -> Iterator[types.ModuleType]:
    for module_name, module in list(sys.modules.items()):
        if _top(module_name) in KNOWN_FRAMEWORKS and isinstance(module, types.ModuleType):
            yield module


def _client_modules() -> Iterator[types.ModuleType]:
    for module_name in TORCH_FSDP_CLIENTS:
        module = sys.modules.get(module_name)
        if isinstance(module, types.ModuleType):
            yield module


def _module_items(module: object) -> list[tuple[str, Any]]:
    # sys.modules may hold objects that are not modules, or modules whose
    # __dict__ is odd; read the dictionary only, never trigger __getattr__.
    if not isinstance(module, types.ModuleType):
        return []
    try:
        return list(vars(module).items())
    except TypeError:
        return []
