"""What a forward saves for backward, per unit, without computing anything.

The forward runs under ``FakeTensorMode`` (tensors with shapes, dtypes and
devices, no data), so the operators dispatch to the kernels a real CPU run
picks (scaled-dot-product attention's fused kernel saves far less than the
math fallback a meta-device forward would take). Every tensor autograd
saves passes through a ``saved_tensors_hooks`` pack hook, which records its
storage once and charges it to the innermost unit whose forward is running;
the model's own parameters are left out (``shard plan`` counts unsharded
parameters separately). The order in which units' forwards start is
recorded too: it is the order the runtime gathers them in, and so are the
tensors each unit's forward is called with (its inputs): under activation
checkpointing they are all a unit keeps from forward to backward.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves

__all__ = ["ActivationProfile", "lm_activation_profile"]


@dataclass(frozen=True)
class ActivationProfile:
    """Saved activations of one forward, per unit.

    Attributes:
        order: Unit names in the order their forwards start (the root, ``""``, first).
        saved: Bytes saved for backward while each unit's own forward ran
            (inside a child unit they are the child's).
        largest: The largest single saved tensor of each unit, in bytes.
        inputs: Bytes of the tensors each unit's forward was called with (a
            storage already an earlier unit's input is not counted again).
    """

    order: tuple[str, ...]
    saved: dict[str, int]
    largest: dict[str, int]
    inputs: dict[str, int]

    @property
    def total(self) -> int:
        """Bytes saved by the whole forward."""
        return sum(self.saved.values())

    def kept(self, checkpointed: Collection[str] = ()) -> int:
        """Bytes the forward leaves for backward when the ``checkpointed`` units recompute.

        A checkpointed unit keeps only its inputs; the rest keep what they save.
        """
        return sum(
            self.inputs.get(name, 0) if name in checkpointed else nbytes
            for name, nbytes in self.saved.items()
        )


class _Ledger:
    """Storages charged to units, each storage once: to the first unit that met it."""

    def __init__(self, names: Collection[str]) -> None:
        self.by_unit: dict[str, dict[int, int]] = {name: {} for name in names}
        self._seen: set[int] = set()

    def charge(self, name: str, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in self._seen:
            self._seen.add(key)
            self.by_unit[name][key] = storage.nbytes()

    def sizes(self, leave_out: set[int]) -> dict[str, list[int]]:
        """Each unit's storage sizes, but those in ``leave_out`` (the parameters)."""
        return {
            name: [n for key, n in charged.items() if key not in leave_out]
            for name, charged in self.by_unit.items()
        }


def lm_activation_profile(
    build: Callable[[], nn.Module],
    unit_names: Sequence[str],
    *,
    batch: int,
    seq: int,
    vocab_size: int,
    dtype: torch.dtype = torch.float32,
    logits_of: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
) -> ActivationProfile:
    """The activations of one language-model step on ``batch`` x ``seq`` tokens.

    ``build`` makes the model (on any device: it is re-created with fake
    CPU storage) computing in ``dtype``; the step is
    ``cross_entropy(logits.float(), targets)``, charged to the root.
    ``unit_names`` are the qualified names of the units (``""``: the root).
    ``logits_of(model, tokens)`` extracts the logits (default: ``model(tokens)``).
    """
    with torch.device("meta"):
        model = build().to(dtype)
    stack = [""]
    order: list[str] = [""]
    names = list(dict.fromkeys([*unit_names, ""]))  # the units' order, the root once
    saved = _Ledger(names)
    inputs = _Ledger(names)

    def enter(name: str) -> Callable[..., None]:
        def hook(_: nn.Module, args: Any, kwargs: Any) -> None:
            stack.append(name)
            if name not in order:
                order.append(name)
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor):
                    inputs.charge(name, leaf)

        return hook

    def leave(*_: Any) -> None:
        stack.pop()

    for name, module in model.named_modules():
        if name in names and name:
            module.register_forward_pre_hook(enter(name), with_kwargs=True)
            module.register_forward_hook(leave)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.charge(stack[-1], tensor)
        return tensor

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = model.to_empty(device="cpu")
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        tokens = torch.zeros((batch, seq), dtype=torch.long)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = logits_of(model, tokens) if logits_of else model(tokens)
            F.cross_entropy(logits.float().reshape(-1, vocab_size), tokens.reshape(-1))
    kept = saved.sizes(params)
    return ActivationProfile(
        order=tuple(order),
        saved={name: sum(sizes) for name, sizes in kept.items()},
        largest={name: max(sizes, default=0) for name, sizes in kept.items()},
        inputs={name: sum(sizes) for name, sizes in inputs.sizes(params).items()},
    )
