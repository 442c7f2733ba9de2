"""What kind of state dict the functional API returns and loads.

Same fields, order, defaults and mutability as
``torch.distributed.checkpoint.state_dict``'s ``StateDictOptions``, so a
script switches by changing its import line, including scripts that build
one options object and flip a field between calls (``opts.strict = False``).
Because the object may change after construction, its fields are checked
when a function uses it (:func:`checked_options`), not when it is built, as
PyTorch does.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection
from dataclasses import dataclass

from torch import nn

__all__ = ["StateDictOptions", "checked_options", "warn_submodules_deprecated"]


@dataclass
class StateDictOptions:
    """Options of :func:`get_state_dict`, :func:`set_state_dict` and their four siblings.

    Attributes:
        full_state_dict: ``False``: values of sharded parameters (and of their
            optimizer state) are the local ``DTensor`` shards, no
            communication. ``True``: plain full tensors, gathered one
            parameter at a time; loading accepts full tensors and keeps only
            this rank's rows.
        cpu_offload: move values to the CPU. With ``full_state_dict`` only
            rank 0 keeps the full values and every other rank gets ``{}``.
        ignore_frozen_params: getting only: leave parameters with
            ``requires_grad=False`` out of the model state dict (their
            optimizer state, if an optimizer holds them, is kept). Loading a
            state dict without them needs ``strict=False``.
        keep_submodule_prefixes: getting only, with the deprecated
            ``submodules`` argument: ``True`` keeps keys as the whole model
            names them (``encoder.layer.weight``); ``False`` strips the
            submodule's own name (``layer.weight``), so pass one submodule.
        strict: loading only: a key the model (or optimizer) has that the
            state dict lacks, or the reverse, is an error naming the first
            such key. ``False``: load what matches and report the rest.
        broadcast_from_rank0: loading only, needs ``full_state_dict``: the
            full state dict exists on rank 0 alone (other ranks pass ``{}``);
            it is broadcast one tensor at a time and every rank keeps its rows,
            so no rank holds more than one full tensor beyond its shards.
        flatten_optimizer_state_dict: optimizer state dicts are flat,
            ``{"state.<fqn>.<name>": value, "param_groups.<fqn>.<option>": value}``,
            instead of ``{"state": {fqn: {...}}, "param_groups": [...]}``.
            Loading accepts either form whatever this says.
        dsd_fqn_modifiers: the name of a method that a module whose state-dict
            hooks rename its keys defines, returning ``{key name: child name}``:
            the key ``<module>.<key name>`` is the tensor of child
            ``<child name>`` (a fused embedding that saves
            ``embedding.weight`` as ``weight`` returns ``{"weight":
            "embedding"}``). ``ignore_frozen_params`` uses it to find a frozen
            parameter's key. (Loading needs no help: the module's own hooks
            map the keys back.) Modules without the method keep their names.
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    ignore_frozen_params: bool = False
    keep_submodule_prefixes: bool = True
    strict: bool = True
    broadcast_from_rank0: bool = False
    flatten_optimizer_state_dict: bool = False
    dsd_fqn_modifiers: str = "_fqn_modifiers"


def checked_options(options: StateDictOptions | None, caller: str) -> StateDictOptions:
    """``options`` (or the defaults), after checking fields that contradict each other.

    Raises:
        ValueError: ``broadcast_from_rank0`` without ``full_state_dict``
            (PyTorch raises ``ValueError`` here too).
    """
    options = options if options is not None else StateDictOptions()
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError(
            f"{caller}: StateDictOptions(broadcast_from_rank0=True) loads a full state dict "
            "held by rank 0, but full_state_dict is False; set full_state_dict=True as well"
        )
    return options


def warn_submodules_deprecated(
    submodules: Collection[nn.Module] | None, caller: str, *, stacklevel: int
) -> None:
    """Warn (``FutureWarning``, as PyTorch does) when ``submodules`` is given and non-empty.

    ``stacklevel`` counts from the caller of this function, so the warning
    points at the user's line.
    """
    if submodules:
        warnings.warn(
            f"{caller}: the submodules argument is deprecated (as in PyTorch, which plans to "
            "remove it); get the whole state dict and keep the keys under the submodule's "
            "prefix instead",
            FutureWarning,
            stacklevel=stacklevel + 1,
        )
