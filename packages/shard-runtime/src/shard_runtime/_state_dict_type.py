"""Which state dict ``FullyShardedDataParallel.state_dict()`` returns, with PyTorch's names.

The configs are mutable dataclasses with PyTorch's fields, defaults and field
order, so code that builds one and then sets ``config.rank0_only = True``
runs unchanged. The type and its config are set on every wrapper of a model
(``FullyShardedDataParallel.set_state_dict_type`` or the
``state_dict_type`` context manager); the root wrapper's ``state_dict()``
and ``load_state_dict()`` honour them. Full and sharded state dicts are
built by shard-checkpoint, reached through the plugin registry.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from torch import nn

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
    "settings_of",
]

_SETTINGS = "_state_dict_settings"


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
        """Settings for ``state_dict_type``, checking that each config is of its kind."""
        if not isinstance(state_dict_type, StateDictType):
            raise TypeError(
                f"state_dict_type must be a StateDictType, got {state_dict_type!r}; use "
                "StateDictType.FULL_STATE_DICT, LOCAL_STATE_DICT or SHARDED_STATE_DICT"
            )
        config_cls, optim_cls = _DEFAULT_CONFIGS[state_dict_type]
        config = state_dict_config if state_dict_config is not None else config_cls()
        optim = optim_state_dict_config if optim_state_dict_config is not None else optim_cls()
        if type(config) is not config_cls:
            raise ValueError(
                f"{state_dict_type.name} takes a {config_cls.__name__}, got {type(config).__name__}"
            )
        if type(optim) is not optim_cls:
            raise ValueError(
                f"{state_dict_type.name} takes a {optim_cls.__name__} as its optimizer config, "
                f"got {type(optim).__name__}"
            )
        return cls(state_dict_type, config, optim)


def settings_of(module: nn.Module) -> StateDictSettings:
    """The state-dict settings of the wrappers in ``module``'s tree.

    Raises:
        ValueError: ``module`` holds no wrapper, or its wrappers disagree.
    """
    found = [m.__dict__[_SETTINGS] for m in module.modules() if _SETTINGS in m.__dict__]
    if not found:
        raise ValueError(
            f"get_state_dict_type: {type(module).__name__} holds no FullyShardedDataParallel; "
            "pass a wrapped model"
        )
    if any(settings != found[0] for settings in found):
        raise ValueError(
            "get_state_dict_type: the wrappers of this model have different state-dict "
            "types; set one for the whole model with set_state_dict_type(model, ...)"
        )
    settings: StateDictSettings = found[0]
    return settings
