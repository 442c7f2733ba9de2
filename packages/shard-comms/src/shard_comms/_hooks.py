"""The default gradient reduction, and applying a comm hook in its place.

A comm hook (protocol :class:`shard_core.protocols.CommHook`) replaces the
reduction of one unit's gradient. It gets a
:class:`~shard_core.protocols.GradReducer`, which performs the plain
reduction in whatever dtype it is handed, so a hook can, say, compress to
bf16, call the reducer, and decompress. :class:`DefaultGradReducer` is that
reducer: a reduce-scatter over the shard group for sharded units, an
all-reduce for unsharded ones, and for hybrid meshes an all-reduce of the
result across the replicate group, with the unit's divide factors applied
once over the whole data-parallel world (FSDP1's way) or, with
``replicas_post_divide``, after each collective (FSDP2's). Hooks are
selected by registered name (``"bf16_compress"``) through the plugin
registry, or passed as a callable.

[Note: One reduction path]
The engine's unit reduces its gradients through this reducer too, with or
without a comm hook: :meth:`DefaultGradReducer.scatter` is the
reduce-scatter (asynchronous in the unit, on its reduce-scatter stream;
through a user's custom collective when one is set) and
:meth:`DefaultGradReducer.all_reduce_replicas` the all-reduce across the
replicate group, which the unit may defer over several backwards. So the
divide-factor staging exists once: ``pre_divide`` before the reduce-scatter,
``post_divide`` after it on a 1-D mesh. On a hybrid one ``post_divide``
follows the replica all-reduce, so the average is taken once (FSDP1's
HYBRID_SHARD), unless ``replicas_post_divide`` is given: then each
collective divides its own result, and a deferred all-reduce sums averages
(FSDP2). The unit passes ``op="sum"`` and the factors of its divide plan.
A unit with a comm codec (``set_comm_codec(grads=...)``) passes it here:
both halves then send encoded rows and sum them in float32
(``_encoded.py``), with the unit's error feedback.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from shard_comms._collectives import (
    CommHandle,
    ReduceAlgorithm,
    ReduceOpName,
    all_reduce,
    reduce_scatter,
    resolve_divide_factors,
)
from shard_comms._custom import CustomReduceScatter, custom_reduce_scatter
from shard_comms._encoded import (
    ErrorFeedback,
    encoded_all_reduce,
    encoded_reduce_scatter,
)
from shard_core import get_registry
from shard_core.errors import CommError, ShardError
from shard_core.plugin import plugin_call_error
from shard_core.protocols import CommCodec, CommHook, GradReducer

__all__ = ["DefaultGradReducer", "default_comm_hook", "reduce_gradient", "resolve_comm_hook"]


def _group_size(group: ProcessGroup | None) -> int:
    if group is not None:
        return group.size()
    return dist.get_world_size()


class DefaultGradReducer:
    """The plain reduction of a unit's gradient (implements ``GradReducer``).

    Args:
        group: The shard group (the all-reduce group for unsharded units);
            ``None`` is the default group.
        replicate_group: For hybrid sharding, the group the reduced shard is
            then all-reduced across; ``None`` otherwise.
        op: ``"avg"`` (divide by the data-parallel size, shard times replicate
            group size) or ``"sum"``.
        pre_divide: Factor applied before communication; ``None`` picks the
            default for ``op`` (see [Note: Divide factors] in ``_collectives.py``).
        post_divide: Factor applied after communication (after the replica
            all-reduce on a hybrid mesh); ``None`` picks the default for
            ``op``, as :func:`resolve_divide_factors` does.
        replicas_post_divide: On a hybrid mesh, the factor the replica
            all-reduce's result is divided by; ``post_divide`` then divides
            the reduce-scatter's result instead. ``None``: the replica
            all-reduce divides by ``post_divide``, and the reduce-scatter not.
        custom_reduce_scatter: A user's reduce-scatter that :meth:`scatter`
            calls instead of shard's (see ``custom_reduce_scatter``); ``None``:
            shard's.
        algorithm: How to reduce-scatter (see :func:`reduce_scatter`).
        label: Label for counters and profiler ranges (the unit's module name).
        codec: Encodes what the reductions send (``_encoded.py``); ``None``:
            they send the gradient's own dtype. Not with ``custom_reduce_scatter``.
        feedback: The error feedback the codec's reductions keep their
            residuals in (one per unit and bucket); ``None``: none.

    ``world_size`` is the size of ``group``: the number of pieces a sharded
    gradient is split into, so ``output`` has ``grad.numel() // world_size``
    elements. ``data_parallel_size`` counts every rank the gradient is
    averaged over (see ``shard_core.protocols.GradReducer``).
    """

    __slots__ = (
        "_algorithm",
        "_codec",
        "_custom",
        "_data_parallel_size",
        "_feedback",
        "_group",
        "_label",
        "_post_divide",
        "_pre_divide",
        "_replicas_post_divide",
        "_replicate_group",
        "_world_size",
    )

    def __init__(
        self,
        group: ProcessGroup | None = None,
        *,
        replicate_group: ProcessGroup | None = None,
        op: ReduceOpName = "avg",
        pre_divide: float | None = None,
        post_divide: float | None = None,
        replicas_post_divide: float | None = None,
        custom_reduce_scatter: CustomReduceScatter | None = None,
        algorithm: ReduceAlgorithm = "auto",
        label: str | None = None,
        codec: CommCodec | None = None,
        feedback: ErrorFeedback | None = None,
    ) -> None:
        if codec is not None and custom_reduce_scatter is not None:
            raise CommError(
                f"DefaultGradReducer({label or 'unlabelled'}): a comm codec and a custom "
                "reduce-scatter both replace the reduce-scatter; set one of them"
            )
        if replicas_post_divide is not None and (op != "sum" or not replicas_post_divide > 0):
            raise CommError(
                f"DefaultGradReducer({label or 'unlabelled'}): replicas_post_divide must be a "
                f"positive number with op='sum', got {replicas_post_divide} with op={op!r}"
            )
        self._group = group
        self._replicate_group = replicate_group
        self._world_size = _group_size(group)
        replicas = 1 if replicate_group is None else replicate_group.size()
        self._data_parallel_size = self._world_size * replicas
        self._pre_divide, self._post_divide = resolve_divide_factors(
            op, self._data_parallel_size, pre_divide, post_divide
        )
        self._replicas_post_divide = replicas_post_divide
        self._custom = custom_reduce_scatter
        self._algorithm: ReduceAlgorithm = algorithm
        self._label = label
        self._codec = codec
        self._feedback = feedback

    # - GradReducer protocol
    @property
    def world_size(self) -> int:
        """Size of the shard group: ``output`` is ``1 / world_size`` of ``grad``."""
        return self._world_size

    @property
    def data_parallel_size(self) -> int:
        """Every rank the gradient is reduced over: shard times replicate group size."""
        return self._data_parallel_size

    @property
    def pre_divide(self) -> float:
        """Factor the gradient is divided by before communication."""
        return self._pre_divide

    @property
    def post_divide(self) -> float:
        """Factor the result is divided by after communication (all of it, on a hybrid mesh)."""
        if self._replicate_group is None or self._replicas_post_divide is None:
            return self._post_divide
        return self._post_divide * self._replicas_post_divide

    def reduce(self, grad: torch.Tensor, output: torch.Tensor | None) -> None:
        """Reduce-scatter ``grad`` into ``output``, or all-reduce it in place when ``None``.

        ``grad`` is scratch afterwards when ``output`` is given.
        """
        if output is None:
            if self._codec is not None:
                encoded_all_reduce(
                    self._codec,
                    grad,
                    self._group,
                    feedback=self._feedback,
                    pre_divide=self._pre_divide,
                    post_divide=self.scatter_post_divide,
                    label=self._label,
                )
            else:
                all_reduce(
                    grad,
                    self._group,
                    pre_divide=self._pre_divide,
                    post_divide=self.scatter_post_divide,
                    label=self._label,
                )
            target = grad
        else:
            target, work = self.scatter(grad, output)
            work.wait()
            if target is not output:  # a custom reduce-scatter wrote into its own buffer
                target = output.copy_(target)
        self.all_reduce_replicas(target)

    # - the two halves of ``reduce``; see [Note: One reduction path]
    @property
    def scatter_post_divide(self) -> float:
        """Factor the reduce-scatter's result is divided by: 1 when the replicas divide."""
        if self._replicate_group is not None and self._replicas_post_divide is None:
            return 1.0
        return self._post_divide

    @property
    def replicas_divide(self) -> float:
        """Factor the replica all-reduce's result is divided by (1 on a 1-D mesh)."""
        if self._replicate_group is None:
            return 1.0
        if self._replicas_post_divide is None:
            return self._post_divide
        return self._replicas_post_divide

    def scatter(
        self, grad: torch.Tensor, output: torch.Tensor | None, *, async_op: bool = False
    ) -> tuple[torch.Tensor, CommHandle]:
        """Reduce-scatter ``grad`` over the shard group; returns the output and its handle.

        ``output`` is where shard's reduce-scatter writes; with a custom
        reduce-scatter it is ``None`` (the custom collective allocates its
        own, which is returned). ``grad`` is scratch until the handle is waited.
        """
        if self._custom is not None:
            if self._group is None:
                raise CommError(
                    "DefaultGradReducer: a custom reduce-scatter needs an explicit shard group; "
                    "pass group="
                )
            return custom_reduce_scatter(
                self._custom,
                grad,
                self._group,
                pre_divide=self._pre_divide,
                post_divide=self.scatter_post_divide,
                label=self._label,
            )
        if output is None:
            raise CommError(
                "DefaultGradReducer.scatter: output is None; pass the tensor that receives "
                "this rank's slice (only a custom reduce-scatter allocates its own)"
            )
        if self._codec is not None:
            return output, encoded_reduce_scatter(
                self._codec,
                output,
                grad,
                self._group,
                feedback=self._feedback,
                pre_divide=self._pre_divide,
                post_divide=self.scatter_post_divide,
                async_op=async_op,
                label=self._label,
            )
        work = reduce_scatter(
            output,
            grad,
            self._group,
            pre_divide=self._pre_divide,
            post_divide=self.scatter_post_divide,
            algorithm=self._algorithm,
            async_op=async_op,
            label=self._label,
        )
        return output, work

    def all_reduce_replicas(self, target: torch.Tensor) -> None:
        """All-reduce the reduced ``target`` across the replicate group; no-op on a 1-D mesh."""
        if self._replicate_group is not None and self._codec is not None:
            encoded_all_reduce(
                self._codec,
                target,
                self._replicate_group,
                feedback=self._feedback,
                path="replicas",
                post_divide=self.replicas_divide,
                label=self._label,
            )
        elif self._replicate_group is not None:
            all_reduce(
                target,
                self._replicate_group,
                pre_divide=1.0,
                post_divide=self.replicas_divide,
                label=self._label,
            ).wait()

    # - extras
    @property
    def group(self) -> ProcessGroup | None:
        """The shard group (``None``: the default group)."""
        return self._group

    @property
    def replicate_group(self) -> ProcessGroup | None:
        """The replicate group of a hybrid mesh, or ``None``."""
        return self._replicate_group

    @property
    def codec(self) -> CommCodec | None:
        """The codec the reductions send with, or ``None``."""
        return self._codec

    def __repr__(self) -> str:
        return (
            f"DefaultGradReducer(world_size={self._world_size}, "
            f"data_parallel_size={self._data_parallel_size}, pre_divide={self._pre_divide}, "
            f"post_divide={self._post_divide}, label={self._label!r})"
        )


def default_comm_hook(
    reducer: GradReducer, grad: torch.Tensor, output: torch.Tensor | None
) -> None:
    """The comm hook that is no hook: the reducer's plain reduction."""
    reducer.reduce(grad, output)


def resolve_comm_hook(hook: str | CommHook | None) -> CommHook | None:
    """The comm hook a user asked for.

    ``None``: none (the default reduction). A string: the hook registered under
    that name through the ``shard_comm_hooks`` plugin hook; an unknown name
    raises :class:`~shard_core.errors.UnknownPluginNameError` listing the
    registered names. A callable: itself.
    """
    if hook is None:
        return None
    if isinstance(hook, str):
        return get_registry().comm_hook(hook)
    if not callable(hook):
        raise TypeError(
            f"comm hook {hook!r} is neither a registered hook name nor a callable "
            "hook(reducer, grad, output); pass a name such as 'bf16_compress' or a function"
        )
    return hook


def reduce_gradient(
    grad: torch.Tensor,
    output: torch.Tensor | None,
    reducer: GradReducer,
    hook: CommHook | None = None,
    *,
    unit: str = "",
) -> None:
    """Reduce one unit's flat gradient: through ``hook`` when given, else ``reducer``.

    ``output`` (sharded units) has ``grad.numel() // reducer.world_size``
    elements and receives this rank's reduced slice; with ``None`` ``grad``
    is all-reduced in place. An exception the hook raises (other than a
    ``ShardError``) becomes a ``PluginCallError`` naming the hook, ``unit``
    (the unit's name, for the message) and whose code raised.
    """
    if output is not None and grad.numel() != output.numel() * reducer.world_size:
        raise CommError(
            f"reduce_gradient: grad has {grad.numel()} elements but an output of "
            f"{output.numel()} over {reducer.world_size} ranks needs "
            f"{output.numel() * reducer.world_size}; pad the flat gradient to a multiple of "
            "the world size"
        )
    if hook is None:
        reducer.reduce(grad, output)
        return
    try:
        hook(reducer, grad, output)
    except ShardError:
        raise
    except Exception as exc:
        where = f" for unit {unit!r}" if unit else ""
        raise plugin_call_error(exc, f"comm hook {_hook_name(hook)}", where) from exc


def _hook_name(hook: CommHook) -> str:
    """A hook as a message names it: its qualified name, else its repr."""
    name = getattr(hook, "__qualname__", None)
    return f"{getattr(hook, '__module__', '?')}.{name}" if isinstance(name, str) else repr(hook)
