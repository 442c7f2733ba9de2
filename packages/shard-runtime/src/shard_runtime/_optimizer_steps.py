"""A count of the optimizer steps this process has taken: a signal every rank sees alike.

A unit kept unsharded between forwards must gather again after its shards
were written (see [Note: a kept unsharded copy is checked before reuse] in
``_unit.py``). Version counters see every write, but an optimizer writes
only the parameters that have a gradient on this rank, and under the
wrapper's ``use_orig_params=True`` a rank's empty piece of a parameter has
none: one rank would gather again and its peer would not, and their
collectives would no longer match. Every rank calls ``optimizer.step()``, so
counting the calls (from the optimizer step pre-hook of ``_step_guard.py``)
gives them one answer.
"""

from __future__ import annotations

__all__ = ["count_optimizer_step", "optimizer_steps"]

_COUNT = [0]


def count_optimizer_step() -> None:
    """Note that an optimizer is about to step (from the global step pre-hook)."""
    _COUNT[0] += 1


def optimizer_steps() -> int:
    """How many optimizer steps this process has begun since it started."""
    return _COUNT[0]
