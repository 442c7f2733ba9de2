"""The model state dicts of ``FullyShardedDataParallel`` and their type, with PyTorch's names.

Every wrapper answers ``state_dict()`` and ``load_state_dict()`` in the form
its state-dict type asks for (``FULL_STATE_DICT`` by default), keyed by the
unwrapped model's names: called on the root, on an inner wrapper, or reached
by a plain parent module's ``state_dict()`` / ``load_state_dict()`` (a
user's container, ``DistributedDataParallel``), as PyTorch's wrapper does
through its state-dict hooks. The work is shard-checkpoint's, reached
through the plugin registry.

[Note: loading through a parent]
``nn.Module.load_state_dict`` walks the module tree parents first and calls
each module's load hooks with the keys under it. The outermost wrapper the
walk reaches takes every key under its prefix out of the state dict and
loads them through the backend (one collective load for its whole subtree),
then records which of them were missing or unexpected. The walk then visits
the wrapper's own subtree, finds none of its keys and reports each raw
tensor there (the flat parameter, ``_fsdp_wrapped_module.`` names) as
missing; the wrapper's load post hook, which runs after its subtree, takes
those back out, leaving what the backend reported. Inner wrappers see that
an outer one is loading and stay out.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any, cast

from torch import nn

from shard_core import get_registry
from shard_runtime._state_dict_type import (
    OptimStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
    raw_state_dicts_active,
    settings_of,
)
from shard_runtime._summon import FLAT_PARAM
from shard_runtime._wrapper_names import WRAPPED, WRAPPED_PREFIX, clean_fqn

__all__ = ["StateDictMethods"]

# The wrapper whose load hook is loading its subtree for a parent's load_state_dict, with the
# prefix it found there and the keys the backend reported missing (see [Note: loading through a
# parent]).
_PARENT_LOAD: contextvars.ContextVar[tuple[StateDictMethods, str, frozenset[str]] | None] = (
    contextvars.ContextVar("shard_parent_load", default=None)
)


class StateDictMethods:
    """Mixed into ``FullyShardedDataParallel``: state dicts and their type; see the module doc.

    The wrappers are recognised by this class, so it needs no import of the
    wrapper's module.
    """

    _state_dict_settings: StateDictSettings

    def _install_state_dict_hooks(self) -> None:
        module = cast(nn.Module, self)
        module.register_state_dict_post_hook(_strip_prefixes)  # type: ignore[no-untyped-call]
        module.register_load_state_dict_pre_hook(_load_pre_hook)  # type: ignore[no-untyped-call]
        module.register_load_state_dict_post_hook(_load_post_hook)  # type: ignore[no-untyped-call]

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The model's state dict of the type set on it (see :meth:`state_dict_type`).

        Keys are the unwrapped model's. ``FULL_STATE_DICT`` (the default, as in
        PyTorch): full tensors, gathered one unit at a time. ``SHARDED_STATE_DICT``:
        ``Shard(0)`` DTensors cut like ``torch.chunk``. ``LOCAL_STATE_DICT``:
        each unit's flat shard as a ``Shard(0)`` DTensor under
        ``<wrapper>._flat_param`` (PyTorch's layout: without the padding that
        evens out the shards, but with ``use_orig_params``), and buffers as
        the model holds them, no communication. Every rank of the
        wrapper's groups takes part; ``prefix`` and ``destination`` work as for
        any module, so a parent module's ``state_dict()`` gets the same keys
        under the wrapper's name.
        """
        destination, prefix, keep_vars = _state_dict_arguments(args, kwargs)
        if raw_state_dicts_active():
            return nn.Module.state_dict(
                cast(nn.Module, self), destination=destination, prefix=prefix, keep_vars=keep_vars
            )
        config = self._state_dict_settings.state_dict_config
        values = (
            get_registry()
            .state_dict_backend()
            .model_state_dict(
                cast(nn.Module, self),
                self._state_dict_settings.state_dict_type.name,
                offload_to_cpu=config.offload_to_cpu,
                rank0_only=bool(getattr(config, "rank0_only", False)),
            )
        )
        out = destination if destination is not None else OrderedDict()
        for key, value in values.items():
            out[prefix + key] = value
        return out

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a state dict of the type set on the model (see :meth:`state_dict`).

        Returns PyTorch's ``(missing_keys, unexpected_keys)``, under the
        unwrapped model's names. ``assign`` is ignored: values are copied into
        the shards.
        """
        if raw_state_dicts_active():
            return nn.Module.load_state_dict(
                cast(nn.Module, self), state_dict, strict=strict, assign=assign
            )
        missing, unexpected = self._load_subtree(state_dict, strict=strict)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def _load_subtree(
        self, state_dict: Mapping[str, Any], *, strict: bool
    ) -> tuple[list[str], list[str]]:
        missing, unexpected = (
            get_registry()
            .state_dict_backend()
            .load_model_state_dict(
                cast(nn.Module, self),
                state_dict,
                self._state_dict_settings.state_dict_type.name,
                strict=strict,
            )
        )
        return missing, unexpected

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> StateDictSettings:
        """Set the state-dict type of every wrapper in ``module``'s tree; return the old one.

        The old settings are the outermost wrapper's; wrappers set to
        different types before are all set to this one (PyTorch refuses to
        when their types differ).

        Raises:
            ValueError: ``module`` holds no wrapper.
            RuntimeError: a config of another type's kind (PyTorch's error).
        """
        settings = StateDictSettings.of(state_dict_type, state_dict_config, optim_state_dict_config)
        wrappers = _wrappers_in(module)
        if not wrappers:
            settings_of(module)  # raises, naming the module
        previous = wrappers[0]._state_dict_settings
        for wrapper in wrappers:
            wrapper._state_dict_settings = settings
        return previous

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        """The state-dict type set on ``module``'s wrappers.

        Raises:
            ValueError: ``module`` holds no wrapper.
            AssertionError: its wrappers have different settings (PyTorch's error).
        """
        return settings_of(module)

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> Iterator[None]:
        """Use ``state_dict_type`` for ``module``'s state dicts inside the block.

        On exit, also when the block raises, each wrapper gets back the
        settings it had.
        """
        before = [(w, w._state_dict_settings) for w in _wrappers_in(module)]
        StateDictMethods.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        )
        try:
            yield
        finally:
            for wrapper, settings in before:
                wrapper._state_dict_settings = settings


def _wrappers_in(module: nn.Module) -> list[StateDictMethods]:
    return [m for m in module.modules() if isinstance(m, StateDictMethods)]


def _state_dict_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, str, bool]:
    """``(destination, prefix, keep_vars)`` as ``nn.Module.state_dict`` reads its arguments."""
    unknown = set(kwargs) - {"destination", "prefix", "keep_vars"}
    if unknown:
        raise TypeError(f"state_dict() got an unexpected keyword argument {sorted(unknown)[0]!r}")
    if args:
        warnings.warn(
            "FullyShardedDataParallel.state_dict: positional arguments are deprecated (as for "
            "any torch module); pass destination=, prefix= and keep_vars= by name",
            FutureWarning,
            stacklevel=3,
        )
    positional = dict(zip(("destination", "prefix", "keep_vars"), args, strict=False))
    merged = {**positional, **kwargs}
    return merged.get("destination"), str(merged.get("prefix", "")), bool(merged.get("keep_vars"))


def _strip_prefixes(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """Raw walks: the wrapper's segments out of the keys (see [Note: raw module state dicts])."""
    for key in [k for k in state_dict if WRAPPED_PREFIX in k or k.endswith(WRAPPED)]:
        state_dict[clean_fqn(key)] = state_dict.pop(key)


def _load_pre_hook(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    if raw_state_dicts_active():
        _restore_prefixes(state_dict, prefix)
        return
    assert isinstance(module, StateDictMethods)
    loading = _PARENT_LOAD.get()
    if loading is not None and any(m is module for m in cast(nn.Module, loading[0]).modules()):
        return  # an outer wrapper loads this one's keys; see [Note: loading through a parent]
    keys = [k for k in state_dict if k.startswith(prefix)]
    subtree = {k[len(prefix) :]: state_dict.pop(k) for k in keys}
    missing, unexpected = module._load_subtree(subtree, strict=False)
    missing_keys.extend(prefix + k for k in missing)
    unexpected_keys.extend(prefix + k for k in unexpected)
    _PARENT_LOAD.set((module, prefix, frozenset(prefix + k for k in missing)))


def _load_post_hook(module: nn.Module, incompatible_keys: Any) -> None:
    loading = _PARENT_LOAD.get()
    if loading is None or cast(nn.Module, loading[0]) is not module:
        return
    _, prefix, reported = loading
    # See [Note: loading through a parent]: the raw tensors the walk found under the wrapper.
    incompatible_keys.missing_keys[:] = [
        k for k in incompatible_keys.missing_keys if not k.startswith(prefix) or k in reported
    ]
    _PARENT_LOAD.set(None)


def _restore_prefixes(state_dict: dict[str, Any], prefix: str) -> None:
    """Undo :func:`_strip_prefixes` below a wrapper, so a raw walk loads back.

    Runs before the wrapper's own keys are matched and before its children's
    hooks (``load_state_dict`` walks parents first), so each wrapper only adds
    its own segment: ``<prefix>rest`` becomes ``<prefix>_fsdp_wrapped_module.rest``
    for every key under the wrapper but its own flat parameter.
    """
    own = prefix + FLAT_PARAM
    inner = prefix + WRAPPED_PREFIX
    for key in [
        k for k in state_dict if k.startswith(prefix) and k != own and not k.startswith(inner)
    ]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)
