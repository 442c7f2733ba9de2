"""``shard plan``'s communication arithmetic: the bytes one rank's collectives move per step.

[Note: communication per step]
Counted as shard's collective counters count them (``shard_comms``, [Note:
What a counted byte is]): per collective, the bytes of its unsharded buffer,
so a 2-rank ``shard train`` reports the same numbers in ``summary.json``
(``comm_per_step``). Per unit with parameters, over a shard group of ``s``
ranks and ``r`` replicas:

- all-gather: ``s`` rows of this unit's per-rank shard in the compute dtype
  (``fully_shard``: each parameter's padded dim-0 rows, ``ceil(dim0 / s)``;
  the wrapper: ``ceil(numel / s)`` of its flat buffer), twice a step for
  units that reshard after forward (``full``, ``hybrid``; the root keeps its
  parameters for backward) and once for the others; none when ``s`` is 1;
- reduce-scatter: ``s`` rows of the unit's trainable shard in the reduce
  dtype (float32 under ``bf16``), once a step; none when ``s`` is 1;
- all-reduce across replicas (``hybrid``, ``no-shard``): the reduced shard,
  once a step when ``r`` is more than 1.

With ``--comm-quant`` a row of ``k`` values counts ``codec.encoded_nbytes(k)``
bytes instead (the codec's own arithmetic, so every block scale is in), and
the all-reduce ``r`` rows of ``ceil(k / r)`` (see [Note: Encoded
collectives] in shard-comms). Units of mixed dtypes (gathered as bytes, which
no codec takes) are outside this arithmetic: a unit counts its largest
element size.

[Note: error-feedback memory]
Quantized gradients with error feedback keep, per unit and between steps,
a float32 residual of what each rank sends: ``s - 1`` rows of the
reduce-scatter (the size of the rank's gradient shard on 2 ranks, nearly
the unit's full gradient on many), and with replicas ``r - 1`` chunks of
``ceil(k / r)`` plus one chunk of the all-reduce. :func:`feedback_bytes`
is their sum; ``set_comm_codec(..., error_feedback=False)`` keeps none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from shard_cli._plan import PlanConfig, UnitPlan, _rows
from shard_core import FlatLayout, padded_dim0_size
from shard_core.protocols import CommCodec

__all__ = ["CommPerStep", "comm_per_step", "feedback_bytes"]

_F32 = 4


@dataclass(frozen=True)
class CommPerStep:
    """Bytes one rank's collectives count in one step, by kind; see [Note: communication per step].

    Attributes:
        all_gather: Parameter all-gathers.
        reduce_scatter: Gradient reduce-scatters.
        all_reduce: Gradient all-reduces across replicas.
    """

    all_gather: int = 0
    reduce_scatter: int = 0
    all_reduce: int = 0

    @property
    def total(self) -> int:
        """Every kind together."""
        return self.all_gather + self.reduce_scatter + self.all_reduce


def _row_numels(unit: UnitPlan, config: PlanConfig, shard: int) -> tuple[int, int]:
    """(all-gather, reduce-scatter) elements of one rank's row of ``unit``."""
    if config.frontend == "wrapper":
        alignment = max(1, 16 // unit.element_size) if config.orig_params else 1
        layout = FlatLayout.from_specs(
            unit.params, dtype=torch.float32, device="meta", alignment=alignment
        )
        n = layout.shard_numel(shard)
        return n, n if unit.trainable else 0
    gather = reduce = 0
    for spec in unit.params:
        dim0, row = _rows(spec, shard, config.flat)
        padded = padded_dim0_size(dim0, shard) * row
        gather += padded
        if spec.name not in unit.frozen:
            reduce += padded
    return gather, reduce


def _bytes(rows: int, numel: int, element_size: int, codec: CommCodec | None) -> int:
    return rows * (numel * element_size if codec is None else codec.encoded_nbytes(numel))


def comm_per_step(
    units: Sequence[UnitPlan],
    config: PlanConfig,
    codecs: Mapping[str, CommCodec] | None = None,
) -> CommPerStep:
    """What one rank's collectives count in a step of ``units`` sharded as ``config`` says.

    ``codecs`` maps ``"weights"`` and/or ``"grads"`` to the codec that
    encodes them (``--comm-quant``). See [Note: communication per step].
    """
    codecs = codecs or {}
    layout = config.layout()
    s, r = layout.shard, layout.replicate
    reshard = config.strategy in ("full", "hybrid")
    root = units[-1].name if units else ""
    weights, grads = codecs.get("weights"), codecs.get("grads")
    gathered = scattered = reduced = 0
    for unit in units:
        if not unit.params:
            continue
        gather, reduce = _row_numels(unit, config, s)
        compute = 2 if config.precision == "bf16" else unit.element_size
        reduce_dtype = _F32 if config.precision == "bf16" else unit.element_size
        if s > 1:
            gathers = 2 if reshard and unit.name != root else 1
            gathered += gathers * _bytes(s, gather, compute, weights)
            if reduce:
                scattered += _bytes(s, reduce, reduce_dtype, grads)
        if r > 1 and reduce:
            if grads is None:
                reduced += reduce * reduce_dtype
            else:
                reduced += _bytes(r, -(-reduce // r), reduce_dtype, grads)
    return CommPerStep(all_gather=gathered, reduce_scatter=scattered, all_reduce=reduced)


def feedback_bytes(units: Sequence[UnitPlan], config: PlanConfig) -> int:
    """Bytes of error-feedback residuals one rank keeps with quantized gradients.

    See [Note: error-feedback memory].
    """
    layout = config.layout()
    s, r = layout.shard, layout.replicate
    total = 0
    for unit in units:
        if not unit.params:
            continue
        _, reduce = _row_numels(unit, config, s)
        if not reduce:
            continue
        if s > 1:
            total += (s - 1) * reduce * _F32
        if r > 1:
            chunk = -(-reduce // r)
            total += r * chunk * _F32
    return total
