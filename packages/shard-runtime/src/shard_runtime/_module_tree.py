"""Walking the module tree a front end shards: the parameters a unit takes, and their owners.

Both front ends take a unit's parameters the same way: depth first, each
module's own parameters before its children's (the order of
``named_modules``, which is PyTorch's flat-parameter order too), each
parameter once under its first name, with every ``(module, name)`` that
registers it (tied weights have several owners, and a module reached twice
is one owner). Materialising, moving and broadcasting a wrapped model go
breadth first instead (:func:`modules_breadth_first`), the order PyTorch's
wrapper calls ``param_init_fn`` in, so an initialiser drawing random numbers
draws them in the same order.

[Note: no recursive closures over parameters]
A nested function that calls itself holds a reference to itself through its
closure cell, a cycle that only the garbage collector breaks; every variable
it closes over lives as long. The walk below once recursed that way over a
dict of the parameters it found: after ``FullyShardedDataParallel`` flattened a
model, every rank kept the whole unsharded model alive (14.2 MiB of the
benchmark's GPT, ``tools/bench/memory_profile.py``) until the next collection.
Walks over modules use an explicit stack.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

from torch import nn

from shard_runtime._param import ParamOwner

__all__ = ["OwnedParam", "modules_breadth_first", "owned_params"]


class OwnedParam(NamedTuple):
    """A parameter a unit takes: its name under the unit, itself, and who registers it."""

    fqn: str
    param: nn.Parameter
    owners: list[ParamOwner]


def owned_params(
    tops: Sequence[nn.Module],
    *,
    enter: Callable[[nn.Module, str], bool],
    take: Callable[[nn.Parameter], bool],
) -> list[OwnedParam]:
    """The parameters ``take`` accepts under ``tops``, not looking inside modules ``enter`` refuses.

    ``enter(module, prefix)`` is asked for every module reached (``prefix``
    is its name under the unit, with a trailing dot); it may raise to refuse
    the module with a message. Several tops (a grouped ``fully_shard`` call)
    name their parameters ``"<index>.<name>"``.
    """
    found: dict[int, OwnedParam] = {}
    # An explicit stack, not a nested function calling itself: see [Note: no recursive
    # closures over parameters].
    for index, top in enumerate(tops):
        stack = [(top, f"{index}." if len(tops) > 1 else "")]
        while stack:
            module, prefix = stack.pop()
            if not enter(module, prefix):
                continue
            for name, param in module._parameters.items():
                if param is None or not take(param):
                    continue
                entry = found.setdefault(id(param), OwnedParam(prefix + name, param, []))
                owner = ParamOwner(module, name)
                if owner not in entry.owners:
                    entry.owners.append(owner)
            children = [
                (child, f"{prefix}{child_name}.")
                for child_name, child in module._modules.items()
                if child is not None
            ]
            stack.extend(reversed(children))  # the first child is visited next, depth first
    return list(found.values())


def modules_breadth_first(root: nn.Module, stop: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """``root`` and its submodules breadth-first, each once, not entering ``stop`` modules."""
    order = [root]
    seen = {id(root)}
    queue = deque([root])
    while queue:
        for child in queue.popleft().children():
            if id(child) in seen or stop(child):
                continue
            seen.add(id(child))
            order.append(child)
            queue.append(child)
    return order
