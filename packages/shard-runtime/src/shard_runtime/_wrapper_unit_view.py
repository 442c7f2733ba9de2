"""What state-dict code needs to know about the units of ``FullyShardedDataParallel``.

shard-checkpoint turns a wrapper's flat shards into per-parameter state
(model and optimizer state dicts) and back. It sees each unit through a
:class:`FlatUnit`: the original parameters with the keys they have in the
unwrapped model, the unit's :class:`~shard_core.FlatLayout`, the local flat
shard and the group it is sharded over. That keeps the engine's private
objects (states, param groups) private.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shard_comms import all_gather
from shard_core import FlatLayout, ShardMetadata
from shard_runtime._flat_buffer_layout import FlatBufferLayout
from shard_runtime._state import UnitState, get_state
from shard_runtime._unit import ShardedState
from shard_runtime._wrapper_names import clean_fqn

__all__ = [
    "FlatUnit",
    "FlatUnitParam",
    "flat_layout_of",
    "flat_units",
    "original_buffer_dtypes",
    "record_buffer_dtype",
    "set_flat_layout",
]

_BUFFER_DTYPES = "_shard_buffer_dtypes"
_FLAT_LAYOUT = "_shard_flat_layout"


def set_flat_layout(state: UnitState, layout: FlatBufferLayout) -> None:
    """Record the flat layout the wrapper built for ``state``'s unit.

    The engine sees a unit's layout only through the ``UnitLayout``
    protocol; the wrapper's own views (state dicts, ``summon_full_params``)
    need the flat buffer itself, so the wrapper keeps it here, on its module.
    """
    state.modules[0].__dict__[_FLAT_LAYOUT] = layout


def flat_layout_of(state: UnitState) -> FlatBufferLayout | None:
    """The flat layout of a wrapper's unit; ``None`` for a unit ``fully_shard`` built."""
    return cast("FlatBufferLayout | None", state.modules[0].__dict__.get(_FLAT_LAYOUT))


@dataclass(frozen=True, slots=True)
class FlatUnitParam:
    """One original parameter of a flat unit.

    Attributes:
        keys: its keys in the unwrapped model's state dict, one per module that
            registers it (tied weights have several); the first is its name.
        shape: its full shape.
        param: the ``nn.Parameter`` an optimizer holds for it with
            ``use_orig_params=True`` (its data is this rank's 1-D piece of the
            shard, possibly empty, or the whole parameter in its own shape on
            a shard axis of one rank); ``None`` with ``use_orig_params=False``.
    """

    keys: tuple[str, ...]
    shape: torch.Size
    param: nn.Parameter | None


@dataclass(frozen=True, slots=True)
class FlatUnit:
    """One unit of ``FullyShardedDataParallel``, for state-dict code.

    Attributes:
        wrapper: the wrapper that owns the unit.
        params: its original parameters, in the layout's order.
        layout: where each parameter lies in the flat buffer.
        rank: this rank's index on the shard axis.
        world: ranks on the shard axis.
        mesh: the unit's mesh (1-D, or (replicate, shard) for hybrid strategies).
        flat_param: the parameter an optimizer holds for the whole unit
            (``use_orig_params=False``); ``None`` with ``use_orig_params=True``.
        compute_device: where the unit computes (and gathers).
    """

    wrapper: nn.Module
    params: tuple[FlatUnitParam, ...]
    layout: FlatLayout
    rank: int
    world: int
    mesh: DeviceMesh
    flat_param: nn.Parameter | None
    compute_device: torch.device
    _state: UnitState

    @property
    def use_orig_params(self) -> bool:
        return self.flat_param is None

    @property
    def shard(self) -> torch.Tensor:
        """This rank's flat shard: ``layout.shard_numel(world)`` elements, zero-padded."""
        layout = flat_layout_of(self._state)
        assert layout is not None  # flat_units lists wrapper units only
        return layout.shard

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel(self.world)

    @property
    def meta(self) -> ShardMetadata:
        """Which parameters' elements this rank's shard holds, and where."""
        return self.layout.shard_metadata(self.rank, self.world)

    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self._state.unit.shard_group

    def gather(self, local: torch.Tensor, *, label: str) -> torch.Tensor:
        """All-gather a 1-D ``shard_numel`` tensor over the shard axis (``world * shard_numel``).

        A collective over the unit's shard group: every rank calls it with a
        tensor of the same dtype.
        """
        local = local.to(self.compute_device).contiguous()
        out = torch.empty(self.world * local.numel(), dtype=local.dtype, device=local.device)
        all_gather(out, local, self.shard_group, label=label).wait()
        return out

    def ensure_sharded(self) -> None:
        """Free the unit's unsharded parameters if a step left them, before shards are written."""
        unit = self._state.unit
        if unit.sharded_state is not ShardedState.SHARDED:
            unit.reshard()


def flat_units(model: nn.Module) -> list[FlatUnit]:
    """Every ``FullyShardedDataParallel`` unit in ``model`` that holds parameters, in module order.

    Keys are relative to ``model`` and free of the wrapper's
    ``_fsdp_wrapped_module`` segments.
    """
    names = {id(m): clean_fqn(n) for n, m in model.named_modules(remove_duplicate=False)}
    units: list[FlatUnit] = []
    seen: set[int] = set()
    for wrapper in model.modules():
        state = get_state(wrapper)
        if state is None or id(state) in seen:
            continue
        seen.add(id(state))
        layout = flat_layout_of(state)
        if layout is None or layout.flat_layout is None:
            continue  # a fully_shard unit, or a wrapper whose children hold every parameter
        params = tuple(
            FlatUnitParam(
                keys=tuple(_join(names[id(o.module)], o.name) for o in spec.owners),
                shape=torch.Size(shape.shape),
                param=spec.param if layout.use_orig_params else None,
            )
            for spec, shape in zip(layout.specs, layout.flat_layout.params, strict=True)
        )
        units.append(
            FlatUnit(
                wrapper=wrapper,
                params=params,
                layout=layout.flat_layout,
                rank=layout.rank,
                world=layout.world,
                mesh=state.unit.mesh,
                flat_param=layout.flat_param,
                compute_device=state.unit.compute_device,
                _state=state,
            )
        )
    return units


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def record_buffer_dtype(module: nn.Module, name: str, dtype: torch.dtype) -> None:
    """Remember that buffer ``name`` of ``module`` was ``dtype`` before mixed precision cast it."""
    module.__dict__.setdefault(_BUFFER_DTYPES, {}).setdefault(name, dtype)


def original_buffer_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """Keys of the buffers a wrapper's ``MixedPrecision.buffer_dtype`` cast, with their dtypes.

    State dicts give these buffers back in their original dtype, so that
    mixed precision never leaks into a checkpoint.
    """
    found: dict[str, torch.dtype] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, dtype in module.__dict__.get(_BUFFER_DTYPES, {}).items():
            found[_join(clean_fqn(prefix), name)] = dtype
    return found
