"""The protocols a shard plugin implements.

Plugins depend on ``shard-core`` only, so everything a plugin needs to know
about the layers above it is written down here as a structural type: a wrap
policy decides which submodules become units, a comm hook reduces a unit's
gradient through a reducer the communication layer hands it, and a device
handle hides one device type's streams, events and memory statistics.
A state-dict backend gives the wrapper front end its model state dicts,
which live in a higher layer (shard-checkpoint). A comm codec encodes what a
unit sends on the wire (quantized all-gathers and reductions) and decodes
what it receives; the communication layer runs the collectives around it.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = [
    "CommCodec",
    "CommHook",
    "DeviceHandle",
    "EventLike",
    "GradReducer",
    "StateDictBackend",
    "StreamLike",
    "WrapDecision",
    "WrapPolicy",
]

# ---------------------------------------------------------------------------
# Wrap policies
# ---------------------------------------------------------------------------

WrapDecision = bool | Mapping[str, Any]
"""What a wrap policy answers for one module.

``False``: the module does not become a unit (its parameters stay with the
nearest unit above it). ``True``: it becomes a unit with the caller's keyword
arguments. A mapping: it becomes a unit, and the mapping overrides some of
the caller's keyword arguments for this unit only (``CustomPolicy``).
"""


@runtime_checkable
class WrapPolicy(Protocol):
    """Decides, bottom-up, which submodules of a model become units.

    The walker visits modules in post-order (children before parents) and
    asks :meth:`wrap` for each module it reaches; :meth:`descend` lets a
    policy keep the walker out of a subtree (a leaf such as
    ``MultiheadAttention``, whose submodules must never be units).
    """

    def descend(self, module: nn.Module, name: str) -> bool:
        """Whether submodules of ``module`` (qualified name ``name``) may become units."""
        ...

    def wrap(self, module: nn.Module, name: str, unwrapped_numel: int) -> WrapDecision:
        """Decide for ``module``.

        ``unwrapped_numel`` counts the parameters in the subtree of ``module``
        that no unit below it has claimed yet (what a size policy compares
        against its threshold).
        """
        ...


# ---------------------------------------------------------------------------
# Gradient comm hooks
# ---------------------------------------------------------------------------


@runtime_checkable
class GradReducer(Protocol):
    """The reduction the communication layer offers a comm hook.

    It is the default reduction of a unit's gradient: a reduce-scatter into
    the rank's shard when the unit is sharded, an all-reduce in place when it
    is not, with the divide factors of the unit applied. It works in whatever
    dtype it is given, which is what lets a hook compress.

    Two sizes describe it, and they differ under hybrid sharding (a 2-D
    (replicate, shard) mesh), where the gradient is reduce-scattered over the
    shard group and the shard then all-reduced across the replicate group:

    - :attr:`world_size` is the size of the shard group, the number of pieces
      a sharded gradient is cut into: ``output`` has
      ``grad.numel() // world_size`` elements;
    - :attr:`data_parallel_size` counts every rank whose gradient enters the
      result, ``world_size`` times the number of replicas; averaging divides
      by it (``pre_divide * post_divide == data_parallel_size`` for an
      average).

    Without a replicate axis both are the group size.
    """

    @property
    def world_size(self) -> int:
        """Size of the shard group: a sharded ``output`` is ``1 / world_size`` of ``grad``."""
        ...

    @property
    def data_parallel_size(self) -> int:
        """Ranks whose gradients are summed into the result: shard group size times replicas."""
        ...

    @property
    def pre_divide(self) -> float:
        """Factor the gradient is divided by before communication."""
        ...

    @property
    def post_divide(self) -> float:
        """Factor the result is divided by after communication."""
        ...

    def reduce(self, grad: torch.Tensor, output: torch.Tensor | None) -> None:
        """Reduce ``grad`` across all ``data_parallel_size`` ranks.

        With ``output`` (a tensor of ``grad.numel() // world_size`` elements,
        same dtype as ``grad``), reduce-scatter into it (then all-reduce it
        across replicas); with ``None``, all-reduce ``grad`` in place. Divide
        factors are applied here. ``grad`` may be used as scratch space.
        """
        ...


@runtime_checkable
class CommHook(Protocol):
    """A gradient communication hook: replaces the default reduction of a unit.

    Called once per unit per backward with the unit's unsharded, flat
    gradient. It must leave the reduced result in ``output`` (sharded units)
    or in ``grad`` itself (``output is None``: unsharded units), in the dtype
    of those tensors. ``reducer`` performs the plain reduction; a hook may
    call it on a transformed tensor (a lower precision copy, say).
    """

    def __call__(
        self, reducer: GradReducer, grad: torch.Tensor, output: torch.Tensor | None
    ) -> None: ...


# ---------------------------------------------------------------------------
# Comm codecs
# ---------------------------------------------------------------------------


@runtime_checkable
class CommCodec(Protocol):
    """Encodes rows of values into rows of bytes for the wire, and decodes them again.

    A codec is pure tensor code: the communication layer runs the collectives
    (an all-gather of encoded shards, an all-to-all of encoded gradient
    chunks) and asks the codec only to encode what this rank sends and
    decode what it receives. The contract that makes every rank agree:

    - the encoded size of a row depends on its number of elements only
      (:meth:`encoded_nbytes`), so every rank sizes the collective alike;
    - :meth:`decode` is a pure function of the bytes: every rank that decodes
      the same bytes gets bitwise the same values, the encoder included;
    - :meth:`encode` with a ``residual`` (error feedback) encodes
      ``values + residual`` and leaves in ``residual`` exactly what that sum
      loses: ``values + residual_before - decode(encoded)``.

    Codecs are looked up by name through the ``shard_comm_codecs`` hook
    (``Registry.comm_codec("int8")``). One codec object may serve many units
    and threads at once: the memory a codec needs between calls (the error
    feedback residual) is owned and passed in by the caller.
    """

    def encoded_nbytes(self, numel: int) -> int:
        """Bytes one row of ``numel`` values encodes into."""
        ...

    def encode(
        self, values: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None
    ) -> None:
        """Encode each row of the 2-D ``values`` into the same row of ``out``.

        ``values`` is floating point, ``(rows, numel)``; ``out`` is
        ``torch.uint8``, ``(rows, encoded_nbytes(numel))``. With ``residual``
        (``torch.float32``, the shape of ``values``): add it first and store
        back what the encoding lost (see the class docstring).
        """
        ...

    def decode(self, encoded: torch.Tensor, out: torch.Tensor) -> None:
        """Decode each row of ``encoded`` (``torch.uint8``) into the same row of ``out``.

        ``out`` is floating point, ``(rows, numel)``; values are computed in
        float32 and cast into ``out``'s dtype.
        """
        ...


# ---------------------------------------------------------------------------
# Device handles
# ---------------------------------------------------------------------------


@runtime_checkable
class EventLike(Protocol):
    """A point in a stream's work that other streams or the host can wait on."""

    def record(self, stream: StreamLike | None = None) -> None:
        """Mark the current end of ``stream`` (the current stream when ``None``)."""
        ...

    def wait(self, stream: StreamLike | None = None) -> None:
        """Make ``stream`` (the current stream when ``None``) wait for this event."""
        ...

    def query(self) -> bool:
        """Whether all work before the event has completed."""
        ...

    def synchronize(self) -> None:
        """Block the host until all work before the event has completed."""
        ...


@runtime_checkable
class StreamLike(Protocol):
    """An ordered queue of device work."""

    def wait_stream(self, stream: StreamLike) -> None:
        """Order future work on this stream after all work now queued on ``stream``."""
        ...

    def wait_event(self, event: EventLike) -> None:
        """Order future work on this stream after ``event``."""
        ...

    def record_event(self, event: EventLike | None = None) -> EventLike:
        """Record ``event`` (a new one when ``None``) at the end of this stream."""
        ...

    def synchronize(self) -> None:
        """Block the host until all work on this stream has completed."""
        ...


@runtime_checkable
class DeviceHandle(Protocol):
    """One device type's runtime, as the engine uses it.

    CPU is built into ``shard-core`` (no-op streams and events, process memory
    statistics); CUDA and other accelerators come from plugins through the
    ``shard_device_handle`` hook.
    """

    @property
    def device_type(self) -> str:
        """The ``torch.device`` type this handle serves (``"cpu"``, ``"cuda"``...)."""
        ...

    @property
    def backend(self) -> str:
        """The ``torch.distributed`` backend for this device type (``"gloo"``, ``"nccl"``...)."""
        ...

    def is_available(self) -> bool:
        """Whether at least one device of this type is usable in this process."""
        ...

    def device_count(self) -> int:
        """Number of devices of this type visible to this process."""
        ...

    def current_device(self) -> torch.device:
        """The device that new tensors of this type land on."""
        ...

    def set_device(self, device: torch.device | int) -> None:
        """Make ``device`` the current device of this process."""
        ...

    def new_stream(self, priority: int = 0) -> StreamLike:
        """A new stream; lower ``priority`` numbers run first where supported."""
        ...

    def current_stream(self) -> StreamLike:
        """The stream that work is queued on now."""
        ...

    def stream(self, stream: StreamLike) -> AbstractContextManager[None]:
        """Make ``stream`` current inside a ``with`` block."""
        ...

    def new_event(self) -> EventLike:
        """A new event."""
        ...

    def record_stream(self, tensor: torch.Tensor, stream: StreamLike) -> None:
        """Tell the allocator ``tensor`` is used on ``stream`` (no-op without caching)."""
        ...

    def synchronize(self) -> None:
        """Block the host until all work on the current device has completed."""
        ...

    def memory_stats(self) -> Mapping[str, int]:
        """Memory statistics in bytes: at least ``allocated`` and ``peak_allocated``."""
        ...

    def reset_peak_memory_stats(self) -> None:
        """Start a new peak measurement."""
        ...


# ---------------------------------------------------------------------------
# State dicts of the wrapper front end
# ---------------------------------------------------------------------------


@runtime_checkable
class StateDictBackend(Protocol):
    """Builds and loads the model and optimizer state dicts of ``FullyShardedDataParallel``.

    ``state_dict_type`` is the name of a ``shard_runtime.StateDictType``
    member (``"FULL_STATE_DICT"``, ``"SHARDED_STATE_DICT"``,
    ``"LOCAL_STATE_DICT"``); the wrapper passes the options of its state-dict
    config as keyword arguments. Every method is a collective over the
    model's ranks unless it says otherwise.
    """

    def model_state_dict(
        self,
        module: nn.Module,
        state_dict_type: str,
        *,
        offload_to_cpu: bool,
        rank0_only: bool,
    ) -> dict[str, Any]:
        """``module``'s state dict of that type, keyed by the original parameter names."""
        ...

    def load_model_state_dict(
        self,
        module: nn.Module,
        state_dict: Mapping[str, Any],
        state_dict_type: str,
        *,
        strict: bool,
    ) -> tuple[list[str], list[str]]:
        """Load ``state_dict`` into ``module``'s shards; return (missing, unexpected) keys."""
        ...

    def optim_state_dict(
        self,
        module: nn.Module,
        optim: torch.optim.Optimizer,
        state_dict_type: str,
        *,
        offload_to_cpu: bool,
        rank0_only: bool,
        optim_state_dict: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        """``optim``'s state keyed by the original parameter names (full, or sharded DTensors).

        ``optim_state_dict``, when given, is ``optim.state_dict()`` as the caller took it.
        """
        ...

    def optim_state_dict_to_load(
        self,
        module: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: Mapping[str, Any],
        *,
        broadcast_from_rank0: bool,
    ) -> dict[str, Any]:
        """The positional state dict ``optim.load_state_dict`` takes for this rank's shards."""
        ...

    def rekey_optim_state_dict(
        self,
        optim_state_dict: Mapping[str, Any],
        key_type: str,
        module: nn.Module,
        optim: torch.optim.Optimizer | None,
    ) -> dict[str, Any]:
        """``optim_state_dict`` keyed by ``"PARAM_NAME"`` or ``"PARAM_ID"`` (no communication)."""
        ...
