"""Which state dict ``FullyShardedDataParallel.state_dict()`` returns, with PyTorch's names.

The configs are mutable dataclasses with PyTorch's fields, defaults and field
order, so code that builds one and then sets ``config.rank0_only = True``
runs unchanged. The type and its config are set on every wrapper of a model
(``FullyShardedDataParallel.set_state_dict_type`` or the
``state_dict_type`` context manager); every wrapper's ``state_dict()`` and
``load_state_dict()`` honour them, called directly or by a parent module.
Full and sharded state dicts are built by shard-checkpoint, reached through
the plugin registry.

[Note: raw module state dicts]
A wrapper's ``state_dict()`` and ``load_state_dict()`` speak the unwrapped
model's keys, also when a plain parent module reaches them (a user's
container, ``DistributedDataParallel``). The code that builds those state
dicts in turn walks the model with ``nn.Module.state_dict`` and
``nn.Module.load_state_dict`` to collect buffers and parameters no unit
holds; inside :func:`raw_module_state_dicts` the wrappers answer that walk
as plain modules (their flat parameter, the ``_fsdp_wrapped_module``
segments), instead of starting a state dict of their own in the middle of
one.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from shard_runtime._wrapper_names import clean_fqn

__all__ = [
    "FullOptimStateDictConfig",
    "OptimStateKeyType",
    "FullStateDictConfig",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "OptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "raw_module_state_dicts",
    "raw_state_dicts_active",
    "settings_of",
]

_SETTINGS = "_state_dict_settings"

_RAW: contextvars.ContextVar[bool] = contextvars.ContextVar("shard_raw_state_dicts", default=False)


@contextlib.contextmanager
def raw_module_state_dicts() -> Iterator[None]:
    """Inside, wrappers answer ``state_dict``/``load_state_dict`` walks as plain modules.

    See [Note: raw module state dicts].
    """
    token = _RAW.set(True)
    try:
        yield
    finally:
        _RAW.reset(token)


def raw_state_dicts_active() -> bool:
    """Whether a :func:`raw_module_state_dicts` block is running in this context."""
    return _RAW.get()


class StateDictType(enum.Enum):
    """The kinds of model state dict of ``FullyShardedDataParallel``.

    ``FULL_STATE_DICT``: original names, full plain tensors, gathered unit by
    unit. ``LOCAL_STATE_DICT``: what each rank holds as it is (the flat
    shards), no communication. ``SHARDED_STATE_DICT``: original names, each
    parameter a ``Shard(0)`` DTensor cut like ``torch.chunk``.
    """

    FULL_STATE_DICT = enum.auto()
    LOCAL_STATE_DICT = enum.auto()
    SHARDED_STATE_DICT = enum.auto()


class OptimStateKeyType(enum.Enum):
    """How ``rekey_optim_state_dict`` keys optimizer state.

    ``PARAM_NAME``: by the parameter's qualified name in the unwrapped model
    (what the wrapper's optimizer state dicts use). ``PARAM_ID``: by position,
    as a plain ``torch.optim`` optimizer over the unwrapped model does.
    """

    PARAM_NAME = enum.auto()
    PARAM_ID = enum.auto()


@dataclass
class StateDictConfig:
    """Options shared by every state-dict type.

    Attributes:
        offload_to_cpu: move the values to the CPU.
    """

    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    """Options of ``FULL_STATE_DICT``.

    Attributes:
        offload_to_cpu: gather each unit onto the CPU.
        rank0_only: only rank 0 keeps the values; every other rank gets ``{}``.
    """

    rank0_only: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    """Options of ``LOCAL_STATE_DICT``.

    Attributes:
        offload_to_cpu: move the values to the CPU.
    """


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    """Options of ``SHARDED_STATE_DICT``.

    Attributes:
        offload_to_cpu: the DTensors' local tensors on the CPU.
        _use_dtensor: kept so that configs written for PyTorch construct and
            compare the same; values are ``DTensor``s whatever it says (PyTorch's
            other choice, ``ShardedTensor``, is deprecated there).
    """

    _use_dtensor: bool = False


@dataclass
class OptimStateDictConfig:
    """Options shared by every optimizer state-dict type.

    Attributes:
        offload_to_cpu: move the values to the CPU.
    """

    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    """Options of full optimizer state dicts.

    Attributes:
        offload_to_cpu: move the values to the CPU.
        rank0_only: only rank 0 keeps the values.
    """

    rank0_only: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    """Options of local optimizer state dicts.

    Attributes:
        offload_to_cpu: move the values to the CPU (``False`` here, as in PyTorch).
    """

    offload_to_cpu: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    """Options of sharded optimizer state dicts.

    Attributes:
        offload_to_cpu: move the values to the CPU.
        _use_dtensor: as :attr:`ShardedStateDictConfig._use_dtensor`.
    """

    _use_dtensor: bool = False


_DEFAULT_CONFIGS: dict[StateDictType, tuple[type[StateDictConfig], type[OptimStateDictConfig]]] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
}


@dataclass
class StateDictSettings:
    """The state-dict type of a model and its configs.

    Attributes:
        state_dict_type: the kind of model state dict.
        state_dict_config: its options (:meth:`of` fills in the type's default).
        optim_state_dict_config: the optimizer state dict's options.
    """

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig

    @classmethod
    def of(
        cls,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> StateDictSettings:
        """Settings for ``state_dict_type``, checking that each config is of its kind.

        Raises:
            TypeError: ``state_dict_type`` is not a ``StateDictType``.
            RuntimeError: a config of another type's kind (PyTorch's error and words).
        """
        if not isinstance(state_dict_type, StateDictType):
            raise TypeError(
                f"state_dict_type must be a StateDictType, got {state_dict_type!r}; use "
                "StateDictType.FULL_STATE_DICT, LOCAL_STATE_DICT or SHARDED_STATE_DICT"
            )
        config_cls, optim_cls = _DEFAULT_CONFIGS[state_dict_type]
        config = state_dict_config if state_dict_config is not None else config_cls()
        optim = optim_state_dict_config if optim_state_dict_config is not None else optim_cls()
        if type(config) is not config_cls:
            raise RuntimeError(
                f"Expected state_dict_config of type {config_cls.__name__} but got "
                f"{type(config).__name__}: {state_dict_type.name} takes a {config_cls.__name__}; "
                f"pass {config_cls.__name__}(...) or None for its defaults"
            )
        if type(optim) is not optim_cls:
            raise RuntimeError(
                f"Expected optim_state_dict_config of type {optim_cls.__name__} but got "
                f"{type(optim).__name__}: {state_dict_type.name} takes a {optim_cls.__name__} as "
                f"its optimizer config; pass {optim_cls.__name__}(...) or None for its defaults"
            )
        return cls(state_dict_type, config, optim)


def settings_of(module: nn.Module) -> StateDictSettings:
    """The state-dict settings of the wrappers in ``module``'s tree.

    Raises:
        ValueError: ``module`` holds no wrapper.
        AssertionError: its wrappers disagree (PyTorch's error and words).
    """
    found = [
        (name, m.__dict__[_SETTINGS])
        for name, m in module.named_modules()
        if _SETTINGS in m.__dict__
    ]
    if not found:
        raise ValueError(
            f"get_state_dict_type: {type(module).__name__} holds no FullyShardedDataParallel; "
            "pass a wrapped model"
        )
    first_name, first = found[0]
    for name, other in found[1:]:
        if other != first:
            raise AssertionError(
                "All FSDP modules must have the same state dict settings: the wrapper of "
                f"{_where(name)} has {_describe(other)} but the one of {_where(first_name)} "
                f"has {_describe(first)}; set one for the whole model with "
                "FullyShardedDataParallel.set_state_dict_type(model, ...)"
            )
    settings: StateDictSettings = first
    return settings


def _where(name: str) -> str:
    return repr(clean_fqn(name)) if name else "the model"


def _describe(settings: StateDictSettings) -> str:
    return f"{settings.state_dict_type.name} with {settings.state_dict_config}"
