"""Tensors shared on the meta device, remembered so that materialising them keeps them shared.

A weight tied across modules (an output projection sharing the embedding's)
is one tensor in several module slots. Materialising a meta model one slot
at a time (``to_empty(recurse=False)`` per module, ``load_state_dict(...,
assign=True)`` per key) gives each slot its own tensor and silently unties
them. :func:`meta_tie_groups` notes which slots hold one meta tensor before
that happens; :func:`retie` points each group's slots at one materialised
tensor afterwards. The wrapper's ``param_init_fn`` path and shard-checkpoint's
load into meta tensors both use them (see [Note: Meta materialisation keeps
ties] in ``_wrapper_init.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ["MetaSlot", "meta_tie_groups", "retie"]

MetaSlot = tuple[nn.Module, str, str]
"""``(module, "_parameters" or "_buffers", attribute name)``."""


def meta_tie_groups(modules: Iterable[nn.Module]) -> list[list[MetaSlot]]:
    """The groups of two or more slots of ``modules`` that hold one meta tensor, in order."""
    groups: dict[int, list[MetaSlot]] = {}
    for m in modules:
        for kind in ("_parameters", "_buffers"):
            for key, t in getattr(m, kind).items():
                if t is not None and t.is_meta:
                    groups.setdefault(id(t), []).append((m, kind, key))
    return [slots for slots in groups.values() if len(slots) > 1]


def retie(groups: list[list[MetaSlot]]) -> None:
    """Point each group's materialised slots at the first one's tensor again.

    The first slot no longer on meta wins (its values, as with tying after
    eager construction). A slot still on meta, of the other kind (parameter
    or buffer), or whose tensor changed shape or dtype is left alone.
    """
    for slots in groups:
        current = [(m, kind, key, getattr(m, kind)[key]) for m, kind, key in slots]
        kept = next(
            ((kind, t) for _, kind, _, t in current if t is not None and not t.is_meta), None
        )
        if kept is None:
            continue
        kept_kind, kept_tensor = kept
        for m, kind, key, now in current:
            if (
                kind == kept_kind
                and now is not kept_tensor
                and now is not None
                and not now.is_meta
                and now.shape == kept_tensor.shape
                and now.dtype == kept_tensor.dtype
            ):
                getattr(m, kind)[key] = kept_tensor
