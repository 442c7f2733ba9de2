"""``set_comm_codec`` of both front ends: resolve the codecs once, check every unit, then set.

Both front ends select a unit's codecs the same way (see [Note: Comm codecs]
in ``_unit.py``); this is the one place that turns what the user passed
(names, ``(name, options)`` pairs, codec objects) into codecs and applies
them to a set of units all or nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from shard_comms import CodecSpec, resolve_comm_codec
from shard_runtime._unit import Unit

__all__ = ["set_comm_codecs"]


def set_comm_codecs(
    units: Sequence[Unit],
    weights: CodecSpec | None,
    grads: CodecSpec | None,
    *,
    error_feedback: bool,
    api: str,
) -> None:
    """Encode ``units``' all-gathers with ``weights`` and reductions with ``grads``.

    Each codec is built once (a registered name builds a fresh object) and
    shared by the units; every unit is checked before any changes.

    Raises:
        TypeError: ``error_feedback`` is not a bool, or a codec is neither a
            name, a ``(name, options)`` pair nor a ``CommCodec``.
        UnknownPluginNameError: no plugin registered the name.
        ValueError: a unit has a collective replaced by other means.
    """
    if not isinstance(error_feedback, bool):
        raise TypeError(
            f"{api}: error_feedback must be a bool, got {error_feedback!r} "
            f"({type(error_feedback).__name__})"
        )
    weight_codec = resolve_comm_codec(weights)
    grad_codec = resolve_comm_codec(grads)
    for unit in units:
        unit.check_comm_codecs(weight_codec, grad_codec, api=api)
    for unit in units:
        unit.set_comm_codecs(weight_codec, grad_codec, error_feedback=error_feedback, api=api)
