"""Finding a model's transformer block class, for a policy given none.

Transformer models keep their blocks in one ``nn.ModuleList`` of instances of
one class (``transformer.h`` of ``GPT2Block``, ``model.layers`` of
``LlamaDecoderLayer``), and that list holds most of the model's parameters.
Reading the class off that list lets ``wrap_policy("transformer")`` work on a
model whose block class the user never named.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from shard_core import WrapPlanError

__all__ = ["BlockList", "detect_block_class", "find_block_list", "require_block_list"]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


@dataclass(frozen=True, slots=True)
class BlockList:
    """The ``nn.ModuleList`` a block class was detected from.

    Attributes:
        name: Qualified name of the list in the model (``"transformer.h"``);
            ``""`` when the model itself is the list.
        block_class: The class of every entry of the list.
        num_blocks: Number of entries (two or more).
        numel: Parameter elements the list holds, shared parameters counted once.
    """

    name: str
    block_class: type[nn.Module]
    num_blocks: int
    numel: int


def find_block_list(root: nn.Module) -> BlockList | None:
    """The block list of ``root``, or ``None`` when it has none.

    A block list is an ``nn.ModuleList`` of two or more entries that are all
    of one class (exactly, not merely related by inheritance), that class
    not being a ``ModuleList``/``ModuleDict``, and that hold parameters. Of
    several, the one holding the most parameter elements wins (a list of
    experts inside each block holds less than the list of blocks around
    them); of lists holding as many, the first in ``root.named_modules()``
    order.
    """
    best: BlockList | None = None
    for name, module in root.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        classes = {type(entry) for entry in module}
        if len(classes) != 1:
            continue
        (block_class,) = classes
        if issubclass(block_class, _CONTAINERS):
            continue
        numel = sum(p.numel() for p in module.parameters())
        if numel == 0:
            continue
        if best is None or numel > best.numel:
            best = BlockList(name, block_class, len(module), numel)
    return best


def detect_block_class(root: nn.Module) -> type[nn.Module]:
    """The transformer block class of ``root``: the class of its block list.

    See :func:`find_block_list` for which list that is.

    Raises:
        WrapPlanError: ``root`` has no block list; the message describes
            each ``nn.ModuleList`` it does have and says to pass
            ``block_classes=``.
    """
    return require_block_list(root).block_class


def require_block_list(root: nn.Module) -> BlockList:
    """:func:`find_block_list`, raising where :func:`detect_block_class` raises."""
    found = find_block_list(root)
    if found is None:
        raise WrapPlanError(_not_found_message(root))
    return found


def _not_found_message(root: nn.Module) -> str:
    seen = [
        _describe_list(name, module)
        for name, module in root.named_modules()
        if isinstance(module, nn.ModuleList)
    ]
    return (
        f"TransformerBlockPolicy: found no transformer block class in {type(root).__name__}: "
        f"no nn.ModuleList in it holds two or more modules of one class with parameters "
        f"(nn.ModuleLists seen: {'; '.join(seen) or 'none'}); name the block classes "
        f"instead: TransformerBlockPolicy(block_classes={{MyBlock}}), or "
        f'wrap_policy("transformer", block_classes={{MyBlock}})'
    )


def _describe_list(name: str, module: nn.ModuleList) -> str:
    classes = ", ".join(dict.fromkeys(type(entry).__name__ for entry in module)) or "nothing"
    entries = "1 entry" if len(module) == 1 else f"{len(module)} entries"
    numel = sum(p.numel() for p in module.parameters())
    where = repr(name) if name else "the model itself"
    return f"{where}: {entries} of {classes}, {numel} parameter elements"
