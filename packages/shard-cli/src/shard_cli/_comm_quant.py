"""``--comm-quant``: what ``shard train`` and ``shard plan`` quantize on the wire, and how.

``--comm-quant weights,grads`` quantizes the parameter all-gathers and the
gradient reductions with the ``int8`` codec of shard-comm-quant; a part may
name its codec (``grads=int4``); ``none`` (or nothing) quantizes nothing.
The options hold the parts normalised, ``("weights=int8", "grads=int4")``, in
that order, so equal runs compare equal and ``config.json`` reads back the
same. Codecs come from the plugin registry by name; the model applies them
with ``set_comm_codec`` (either front end), with error feedback on the
gradients.

Parsing and the help text are torch-free, as ``--comm-quant`` is a flag of
the parser ``shard --help`` builds; the runtime is imported only by
:func:`apply_comm_quant`, on a rank with a sharded model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "COMM_QUANT_HELP",
    "DEFAULT_CODEC",
    "SIDES",
    "apply_comm_quant",
    "check_comm_quant",
    "comm_quant_codecs",
    "parse_comm_quant",
]

SIDES = ("weights", "grads")
DEFAULT_CODEC = "int8"
COMM_QUANT_HELP = (
    "quantize what crosses the wire: weights (parameter all-gathers), grads (gradient "
    "reductions, with error feedback), or weights,grads; PART=CODEC picks a codec "
    f"(default {DEFAULT_CODEC}; int4 for grads) from shard-comm-quant; none: off (default)"
)


def parse_comm_quant(value: Any) -> tuple[str, ...]:
    """``value`` (``"weights,grads=int4"``, a list of parts, ``None``) as normalised parts.

    Raises:
        ValueError: a part is not ``weights`` or ``grads`` (with an optional
            ``=CODEC``), or names one side twice.
    """
    if value is None:
        return ()
    if isinstance(value, str):
        items = [item.strip() for item in value.split(",")]
    elif isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        items = [item.strip() for item in value]
    else:
        raise ValueError(f"--comm-quant takes parts such as weights,grads, got {value!r}")
    if items in ([""], ["none"], []):
        return ()
    codecs: dict[str, str] = {}
    for item in items:
        side, _, codec = item.partition("=")
        side, codec = side.strip(), codec.strip() or DEFAULT_CODEC
        if side not in SIDES:
            raise ValueError(
                f"--comm-quant: {item!r} is not a part; use weights, grads or both "
                "(weights,grads), each optionally =CODEC (grads=int4), or none"
            )
        if side in codecs:
            raise ValueError(f"--comm-quant names {side} twice ({value!r}); name it once")
        codecs[side] = codec
    return tuple(f"{side}={codecs[side]}" for side in SIDES if side in codecs)


def comm_quant_codecs(parts: tuple[str, ...]) -> dict[str, str]:
    """``{"weights": "int8", "grads": "int4"}`` for normalised ``parts``; sides not given absent."""
    return dict(part.split("=", 1) for part in parts)


def check_comm_quant(parts: tuple[str, ...]) -> None:
    """Refuse a codec no installed plugin registers, before any rank starts.

    Raises:
        LookupError: the name is not registered; the message lists what is and
            how to install shard-comm-quant.
    """
    if not parts:
        return
    from shard_core import get_registry

    registered = sorted(get_registry().comm_codecs())
    for side, codec in comm_quant_codecs(parts).items():
        if codec not in registered:
            raise LookupError(
                f"--comm-quant {side}={codec}: no comm codec is registered as {codec!r} "
                f"(registered: {', '.join(registered) or 'none'}); install shard-comm-quant "
                "from the shard repository (pip install ./plugins/shard-comm-quant), which "
                "registers int8 and int4"
            )


def apply_comm_quant(model: nn.Module, parts: tuple[str, ...]) -> None:
    """Quantize ``model``'s communication as ``parts`` say (a sharded model, either front end).

    Collective-free: it only selects codecs on every unit of the model.
    """
    if not parts:
        return
    from shard_runtime import FSDPModule, FullyShardedDataParallel

    codecs = comm_quant_codecs(parts)
    weights, grads = codecs.get("weights"), codecs.get("grads")
    if isinstance(model, (FSDPModule, FullyShardedDataParallel)):
        model.set_comm_codec(weights=weights, grads=grads)
        return
    raise TypeError(
        f"--comm-quant: {type(model).__name__} is not sharded (fully_shard or "
        "FullyShardedDataParallel); shard the model first"
    )
