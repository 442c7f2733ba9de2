"""``shard plan``'s arithmetic: the units a wrap policy makes and what each rank holds.

Nothing here allocates a real tensor or talks to a process group: models are
built on the meta device, units come from the runtime's own planner (the
same call ``fully_shard``/the wrapper make), and per-rank sizes come from
shard-core's sharding math (``padded_dim0_size`` and ``dim0_chunk_range`` for
``fully_shard``'s per-parameter shards, ``FlatLayout.shard_numel`` for the
wrapper's flat ones), so a plan for 4096 ranks costs what one for 2 does.

[Note: the memory model]
Per rank, in bytes, counted like ``shard train`` measures them (see
[Note: what a rank holds] in ``_measure.py``):

- parameters: ``fully_shard`` keeps each parameter's padded dim-0 shard
  (``ceil(dim0 / s)`` rows); with ``flat_shard_placement`` (``flat``), a
  matrix whose dim 0 does not divide by ``s`` keeps ``ceil(numel / s)``
  elements of its flattened storage instead (the rule is
  ``shard_runtime``'s ``is_flat_layout``); the wrapper keeps
  ``ceil(numel / s)`` elements of each unit's flat buffer (``s``: the shard
  group size, 1 for no-shard).
- gradients: one reduce-scatter output per unit, the size of its shards,
  of its trainable parameters only (``requires_grad``: ``--lora`` and
  ``--freeze`` freeze the rest, ``_finetune.py``); a wrapper unit's is its
  whole flat shard, or with ``use_orig_params`` (``shard train`` with
  frozen parameters) each trainable parameter's piece of it.
- AdamW: ``exp_avg`` and ``exp_avg_sq`` per trainable parameter in its local
  (``fully_shard``: unpadded rows, or flat elements, of this rank) shape,
  and a 4-byte ``step``; a wrapper unit: per flat shard, or with
  ``use_orig_params`` per trainable parameter with a piece in this shard.
- activations: the tensors autograd saves in forward for backward, per
  unit, counted by running the model's forward on fake tensors (no memory)
  for the given batch and sequence length (``_activations.py``); without an
  example input (a ``module:factory`` model) they are left out. A unit
  under activation checkpointing (``checkpointed``) keeps only the tensors
  its forward was called with, and holds its saved activations again only
  while its backward recomputes and consumes them.
- peak and units in flight: from a simulated step, below.

[Note: a simulated step]
The step is replayed unit by unit with a running total of bytes, starting
from parameters + AdamW state, following what the runtime allocates and
frees (``shard_runtime``'s ``Unit`` and its parameter groups):

- forward, units in the order their forwards start (the root first):
  gather (the all-gather's output exists while the full parameters are
  built from it; ``fully_shard`` writes its input into the output's own
  row, the wrapper's is the shard itself unless it is cast), add the
  unit's saved activations, and with ``full``/``hybrid`` free the full
  parameters again (the root keeps its own until its backward); a
  checkpointed unit adds only its inputs;
- backward, in reverse: with ``full``/``hybrid`` complete the unit's gather
  (issued by the previous unit as a prefetch: its buffers exist from then,
  ``fully_shard``'s unsharded parameters only from now, when the output is
  copied into them) and issue the next one's; a checkpointed unit
  recomputes its saved activations now; add its full gradients (and,
  transiently, the gradients of its largest activation), drop its
  activations (and a checkpointed unit's inputs), free the full
  parameters, then reduce: the reduce-scatter input (``fully_shard`` copies
  the gradients into a padded buffer; the wrapper reduces its flat gradient
  in place) and output appear, and the previous reduction completes (one in
  flight at a time) and its input goes; the root comes last;
- optimizer: one temporary the size of the largest local parameter.

Under activation checkpointing the estimate is an upper bound: it holds a
unit's recomputed activations and its full gradients at once, where the
unit's backward frees the first as it makes the second (10-15% above the
measured peak on a 4-block GPT, ``test_plan.py``).

The estimate's peak is the running total's maximum; "in flight" is the most
full parameters and full gradients held at once. What it leaves out:
allocator rounding, the collectives' staging buffers (CPU), and temporaries
inside one operator beyond its saved activations; ``shard train`` measures
the real peak and prints both.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shard_cli._activations import ActivationProfile
from shard_cli._options import Frontend, Precision, Strategy
from shard_cli._strategy import ShardLayout, shard_layout
from shard_core import FlatLayout, ParamSpec, dim0_chunk_range, padded_dim0_size
from shard_runtime import WrapPolicyLike
from shard_runtime.plumbing import is_flat_layout, plan_units, resolve_wrap_policy

__all__ = [
    "MemoryEstimate",
    "PlanConfig",
    "UnitPlan",
    "estimate_memory",
    "plan_model_units",
    "unsharded_memory",
]

_F32 = 4
_STEP_BYTES = 4  # AdamW's ``step``: a float32 scalar per parameter


@dataclass(frozen=True)
class UnitPlan:
    """One unit of a wrap plan, by shapes only.

    Attributes:
        name: The module's qualified name (``""``: the root).
        module_type: The module's class name.
        params: The parameters the unit manages (qualified names, full shapes).
        frozen: Names of those that do not require gradients.
        element_size: Bytes per element of the parameters.
    """

    name: str
    module_type: str
    params: tuple[ParamSpec, ...]
    frozen: frozenset[str]
    element_size: int

    @property
    def numel(self) -> int:
        """Elements of all of the unit's parameters."""
        return sum(p.numel for p in self.params)

    @property
    def trainable(self) -> tuple[ParamSpec, ...]:
        """The parameters that require gradients."""
        return tuple(p for p in self.params if p.name not in self.frozen)

    @property
    def depth(self) -> int:
        """Nesting level in the module tree (the root is 0)."""
        return 0 if not self.name else self.name.count(".") + 1


def plan_model_units(model: nn.Module, policy: WrapPolicyLike) -> list[UnitPlan]:
    """The units ``policy`` makes of ``model`` (any device, meta included), root last.

    ``policy`` is anything the runtime accepts (a ``WrapPolicy``, a registered
    name, ``None`` for the root alone); units are planned exactly as
    ``fully_shard``'s ``apply_wrap_policy`` and the wrapper's
    ``auto_wrap_policy`` plan them, tied parameters folded into one unit.
    """
    targets = plan_units(model, resolve_wrap_policy(policy))
    claimed: set[int] = set()
    units: list[UnitPlan] = []
    for target in targets:
        specs: list[ParamSpec] = []
        frozen: set[str] = set()
        sizes: set[int] = set()
        for local_name, param in target.module.named_parameters():
            if id(param) in claimed:
                continue
            claimed.add(id(param))
            name = f"{target.name}.{local_name}" if target.name else local_name
            specs.append(ParamSpec(name, tuple(param.shape)))
            sizes.add(param.element_size())
            if not param.requires_grad:
                frozen.add(name)
        units.append(
            UnitPlan(
                name=target.name,
                module_type=type(target.module).__name__,
                params=tuple(specs),
                frozen=frozenset(frozen),
                element_size=max(sizes) if sizes else _F32,
            )
        )
    return units


@dataclass(frozen=True)
class PlanConfig:
    """How a model is sharded, for an estimate.

    Attributes:
        frontend: ``fully_shard`` or ``wrapper``.
        strategy: ``full``, ``grad-op``, ``no-shard`` or ``hybrid``.
        world: Number of ranks.
        shard_size: Shard group size for ``hybrid``; ``None``: the whole world.
        precision: ``fp32`` or ``bf16`` (compute; reductions stay fp32).
        cpu_offload: Shards, gradients and optimizer state on the CPU.
        prefetch: Units gathered ahead of the one computing (the runtime's
            backward prefetch: 1).
        flat: ``fully_shard`` with ``shard_placement_fn=flat_shard_placement``
            (ignored by the wrapper, whose units are flat already).
        orig_params: The wrapper with ``use_orig_params=True`` (what ``shard
            train`` passes when some parameter is frozen; ignored by
            ``fully_shard``): each parameter is 16-byte aligned in the flat
            buffer, and gradients and AdamW state exist per trainable
            parameter, for its piece of this rank's shard.
    """

    frontend: Frontend = "fully_shard"
    strategy: Strategy = "full"
    world: int = 1
    shard_size: int | None = None
    precision: Precision = "fp32"
    cpu_offload: bool = False
    prefetch: int = 1
    flat: bool = False
    orig_params: bool = False

    def layout(self) -> ShardLayout:
        """The replicate x shard split of the ranks."""
        return shard_layout(self.strategy, self.world, self.shard_size or self.world)


@dataclass(frozen=True)
class MemoryEstimate:
    """What one rank holds, in bytes; see [Note: the memory model].

    Attributes:
        config: The configuration estimated.
        rank: The rank described (rank 0 holds the most).
        params: Sharded parameters.
        grads: Sharded gradients after backward.
        optim: AdamW state.
        in_flight: The most full parameters and full gradients held at once.
        activations: Saved activations; ``None`` when not estimated (none are counted).
        peak: The estimated peak.
    """

    config: PlanConfig
    rank: int
    params: int
    grads: int
    optim: int
    in_flight: int
    activations: int | None
    peak: int

    @property
    def state(self) -> int:
        """Parameters + gradients + AdamW state."""
        return self.params + self.grads + self.optim


def _rows(spec: ParamSpec, shard: int, flat: bool) -> tuple[int, int]:
    """(rows split over ranks, elements per row) of a parameter as ``fully_shard`` splits it.

    A 0-d parameter is one row of one; a flat-sharded one is ``numel`` rows of one.
    """
    if not spec.shape:
        return 1, 1
    if flat and is_flat_layout(spec.shape, shard):
        return spec.numel, 1
    return spec.shape[0], math.prod(spec.shape[1:])


@dataclass(frozen=True)
class _Sizes:
    """One unit's bytes on one rank: persistent state and the buffers of one step."""

    params: int = 0  # sharded parameters
    grads: int = 0  # sharded gradients (the reduce-scatter output, kept)
    optim: int = 0  # AdamW state
    unsharded: int = 0  # full parameters in the compute dtype
    gather_temp: int = 0  # all-gather input and output, alive while it completes
    full_grads: int = 0  # gradients of the full parameters, before reduction
    reduce_in: int = 0  # reduce-scatter input beyond full_grads (0: reduced in place)
    into_unsharded: bool = False  # the all-gather writes the unsharded buffer itself (wrapper)


def _unit_sizes(unit: UnitPlan, config: PlanConfig, shard: int, shard_rank: int) -> _Sizes:
    """What ``unit`` costs on one rank; see [Note: the memory model]."""
    if not unit.params:
        return _Sizes()
    e = unit.element_size
    ec = 2 if config.precision == "bf16" else e
    trainable = unit.trainable
    if config.frontend == "wrapper":
        # use_orig_params aligns every parameter to 16 bytes, as PyTorch does.
        alignment = max(1, 16 // e) if config.orig_params else 1
        layout = FlatLayout.from_specs(
            unit.params, dtype=torch.float32, device="meta", alignment=alignment
        )
        n = layout.shard_numel(shard)
        if not trainable:
            return _Sizes(
                params=n * e,
                unsharded=shard * n * ec,
                gather_temp=n * ec if ec != e else 0,
                into_unsharded=True,
            )
        grads, optim = n * _F32, 2 * n * e + _STEP_BYTES
        if config.orig_params:
            # Each trainable parameter's piece of this shard (none: no gradient, no state).
            pieces = [
                info.numel_in_range
                for info in layout.shard_metadata(shard_rank, shard).params
                if info.name not in unit.frozen
            ]
            grads = sum(pieces) * _F32
            optim = sum(2 * k * e + _STEP_BYTES for k in pieces)
        return _Sizes(
            params=n * e,
            grads=grads,
            optim=optim,
            unsharded=shard * n * ec,
            # The all-gather writes into the unsharded buffer; it sends the shard
            # itself unless it must be cast to the compute dtype first.
            gather_temp=n * ec if ec != e else 0,
            full_grads=shard * n * ec,
            reduce_in=shard * n * _F32 if ec != _F32 else 0,
            into_unsharded=True,
        )
    sizes = {"params": 0, "grads": 0, "optim": 0, "unsharded": 0, "full_grads": 0}
    for spec in unit.params:
        dim0, row = _rows(spec, shard, config.flat)
        padded = padded_dim0_size(dim0, shard) * row
        sizes["params"] += padded * e
        sizes["unsharded"] += shard * padded * ec
        if spec.name in unit.frozen:
            continue
        sizes["grads"] += padded * _F32
        sizes["full_grads"] += dim0 * row * ec
        local = len(dim0_chunk_range(dim0, shard_rank, shard)) * row
        sizes["optim"] += 2 * local * e + _STEP_BYTES
    return _Sizes(
        params=sizes["params"],
        grads=sizes["grads"],
        optim=sizes["optim"],
        unsharded=sizes["unsharded"],
        full_grads=sizes["full_grads"],
        # The output (every rank's padded shards); this rank's input is its own row.
        gather_temp=sizes["unsharded"],
        reduce_in=shard * sizes["grads"],
    )


class _Timeline:
    """A running total of bytes held, and its peak."""

    def __init__(self, start: int) -> None:
        self.held = start
        self.peak = start

    def alloc(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def free(self, nbytes: int) -> None:
        self.held -= nbytes


def _simulate_step(
    units: Sequence[UnitPlan],
    sizes: Sequence[_Sizes],
    config: PlanConfig,
    activations: ActivationProfile | None,
    *,
    plain: bool = False,
    checkpointed: Collection[str] = (),
) -> tuple[int, int]:
    """(peak, most full parameters and gradients held) of one step.

    See [Note: a simulated step]. ``plain``: an unsharded model in one process
    (nothing gathered, gradients kept where autograd puts them);
    ``checkpointed``: the units under activation checkpointing.
    """
    by_name = {u.name: (u, s) for u, s in zip(units, sizes, strict=True)}
    root = units[-1].name
    if activations is not None:
        order = [n for n in activations.order if n in by_name]
        order += [u.name for u in units if u.name not in order]
    else:
        order = [root] + [u.name for u in units[:-1]]
    saved = activations.saved if activations else {}
    largest = activations.largest if activations else {}
    inputs = activations.inputs if activations else {}
    recomputed = frozenset(checkpointed) - {root}
    base = sum(s.params + s.optim for s in sizes)
    line = _Timeline(base)
    in_flight = _Timeline(0)
    reshard = config.strategy in ("full", "hybrid")

    def issue(name: str) -> None:
        """Start the all-gather: its buffers (the wrapper's output is the unsharded one)."""
        s = by_name[name][1]
        line.alloc(s.gather_temp + (s.unsharded if s.into_unsharded else 0))
        if s.into_unsharded:
            in_flight.alloc(s.unsharded)

    def finish(name: str) -> None:
        """Complete it: ``fully_shard`` copies the output out into the unsharded parameters."""
        s = by_name[name][1]
        if not s.into_unsharded:
            line.alloc(s.unsharded)
            in_flight.alloc(s.unsharded)
        line.free(s.gather_temp)

    def gather(name: str) -> None:
        issue(name)
        finish(name)

    def release(name: str) -> None:
        line.free(by_name[name][1].unsharded)
        in_flight.free(by_name[name][1].unsharded)

    # forward
    for name in order:
        gather(name)
        if name != root:
            line.alloc(inputs.get(name, 0) if name in recomputed else saved.get(name, 0))
            if reshard:
                release(name)
    line.alloc(saved.get(root, 0))
    # backward: the root's gradients (the head's) come first, its embeddings' last
    blocks = [n for n in reversed(order) if n != root]
    pending: _Sizes | None = None

    def backward(name: str, *, grads_ready: bool = False) -> None:
        nonlocal pending
        s = by_name[name][1]
        if name in recomputed:
            line.alloc(saved.get(name, 0))  # the forward runs again, saving what it saves
        if not grads_ready:
            line.alloc(largest.get(name, 0))  # gradients of its activations, in flight
            line.alloc(s.full_grads)
            in_flight.alloc(s.full_grads)
            line.free(largest.get(name, 0))
        line.free(saved.get(name, 0) + (inputs.get(name, 0) if name in recomputed else 0))
        if plain:
            return
        release(name)  # before the reduction's buffers, as shard_runtime's post-backward does
        # reduce-scatter: input, output; one reduction in flight at a time
        line.alloc(s.reduce_in + s.grads)
        if pending is not None:
            line.free(pending.reduce_in + pending.full_grads * (pending.reduce_in == 0))
        if s.reduce_in:
            line.free(s.full_grads)
        in_flight.free(s.full_grads)
        pending = s

    # The loss's and the head's gradients come first: the root's gradients and
    # the gradient of its largest activation (the logits) are allocated at once.
    root_sizes = by_name[root][1]
    line.alloc(largest.get(root, 0))
    line.alloc(root_sizes.full_grads)
    in_flight.alloc(root_sizes.full_grads)
    line.free(largest.get(root, 0))
    if reshard and blocks:
        issue(blocks[0])  # the root's pre-backward prefetches the last unit
    for k, name in enumerate(blocks):
        # a unit's pre-backward completes its own gather, then prefetches the next one's
        if reshard:
            finish(name)
            if k + 1 < len(blocks):
                issue(blocks[k + 1])
        backward(name)
    backward(root, grads_ready=True)
    # optimizer step: one temporary the size of the largest local parameter
    largest_param = max((p.numel for u in units for p in u.params), default=0)
    shard = 1 if plain else config.layout().shard
    line.alloc(-(-largest_param // shard) * _F32)
    return line.peak, in_flight.peak


def estimate_memory(
    units: Sequence[UnitPlan],
    config: PlanConfig,
    *,
    activations: ActivationProfile | None = None,
    rank: int = 0,
    checkpointed: Collection[str] = (),
) -> MemoryEstimate:
    """What ``rank`` holds when ``units`` are sharded as ``config`` says.

    See [Note: the memory model]. Rank 0 holds the most (shards are cut
    with ``torch.chunk`` semantics: the first ranks get the larger chunks).
    ``checkpointed`` names the units under activation checkpointing.
    """
    layout = config.layout()
    shard_rank = rank % layout.shard
    sizes = [_unit_sizes(u, config, layout.shard, shard_rank) for u in units]
    peak, in_flight = _simulate_step(units, sizes, config, activations, checkpointed=checkpointed)
    return MemoryEstimate(
        config=config,
        rank=rank,
        params=sum(s.params for s in sizes),
        grads=sum(s.grads for s in sizes),
        optim=sum(s.optim for s in sizes),
        in_flight=in_flight,
        activations=activations.kept(checkpointed) if activations else None,
        peak=peak,
    )


def unsharded_memory(
    units: Sequence[UnitPlan],
    *,
    activations: ActivationProfile | None = None,
    checkpointed: Collection[str] = (),
) -> MemoryEstimate:
    """What one process training the whole model without sharding holds (AdamW)."""
    config = PlanConfig(strategy="no-shard", world=1)
    sizes = []
    for unit in units:
        numel = unit.numel
        trainable = unit.trainable
        sizes.append(
            _Sizes(
                params=numel * unit.element_size,
                optim=sum(2 * p.numel * unit.element_size + _STEP_BYTES for p in trainable),
                full_grads=sum(p.numel for p in trainable) * _F32,
            )
        )
    peak, _ = _simulate_step(
        units, sizes, config, activations, plain=True, checkpointed=checkpointed
    )
    return MemoryEstimate(
        config=config,
        rank=0,
        params=sum(s.params for s in sizes),
        grads=sum(s.full_grads for s in sizes),
        optim=sum(s.optim for s in sizes),
        in_flight=0,
        activations=activations.kept(checkpointed) if activations else None,
        peak=peak,
    )
