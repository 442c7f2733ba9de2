"""The ``"transformer"`` wrap policy: each transformer block is a unit.

One unit per block is the split that overlaps communication with compute
best in a transformer: every block gathers its parameters just before it
runs and frees them right after. Given no block class, the policy finds it
on the model it is asked to plan, so ``wrap_policy("transformer")`` works on
models whose classes the user never named (Hugging Face models built from a
config, say).
"""

from __future__ import annotations

import logging

from torch import nn

from shard_core import ModuleClasses, WrapPlanError, as_module_classes
from shard_wrap_transformer._detect import require_block_list

__all__ = ["TransformerBlockPolicy"]

logger = logging.getLogger("shard.wrap")

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)

# [Note: detecting on the root]
# A WrapPolicy is asked about modules one at a time and never handed the model,
# yet detection needs the whole model. plan_wraps asks descend() about the
# root (qualified name "", which no other module can have) before it asks
# anything else, so that is where a policy with no block classes detects
# them; every wrap() of that walk then uses the result. Planning another model
# with the same policy detects again on its root. The protocol has no hook
# that hands a policy the root; this is the one place such a hook would help.


class TransformerBlockPolicy:
    """Each instance of a transformer block class becomes a unit.

    With ``block_classes`` given, instances of those classes (subclasses too,
    as with ``isinstance``) become units. With ``None``, the block class is
    detected on the model being planned: the class of the ``nn.ModuleList``
    of two or more same-class entries that holds the most parameters
    (``GPT2Block`` in ``transformer.h``, ``LlamaDecoderLayer`` in
    ``model.layers``); see :func:`~shard_wrap_transformer.find_block_list`.
    The root is always a unit and keeps what the blocks leave (embeddings,
    final norm, head). Registered as ``"transformer"`` (option
    ``block_classes=``).

    Raises:
        WrapPlanError: on construction, ``block_classes`` is empty or holds
            something that is not an ``nn.Module`` subclass, or a
            ``ModuleList``/``ModuleDict`` (which has no forward, so cannot be
            a unit); when planning with detection, the model has no block
            list (the message says to pass ``block_classes=``).
    """

    __slots__ = ("_block_classes", "_detected")

    def __init__(self, block_classes: ModuleClasses | None = None) -> None:
        self._block_classes: tuple[type[nn.Module], ...] | None = (
            None if block_classes is None else _classes(block_classes)
        )
        self._detected: type[nn.Module] | None = None

    @property
    def block_classes(self) -> tuple[type[nn.Module], ...] | None:
        """The classes given, without duplicates, in the order given; ``None``: detected."""
        return self._block_classes

    @property
    def detected_block_class(self) -> type[nn.Module] | None:
        """The class detected on the last model planned; ``None`` before one, or when given."""
        return self._detected

    def descend(self, module: nn.Module, name: str) -> bool:
        if name == "" and self._block_classes is None:
            # See [Note: detecting on the root]
            self._detected = None  # a model with no block list must not keep the last one's
            self._detected = _detect(module)
        return True

    def wrap(self, module: nn.Module, name: str, unwrapped_numel: int) -> bool:
        if self._block_classes is not None:
            return isinstance(module, self._block_classes)
        if self._detected is None:
            raise WrapPlanError(
                f"TransformerBlockPolicy: asked about module {name!r} "
                f"({type(module).__name__}) before it saw a root to detect the block class on; "
                f"plan with shard_core.plan_wraps(model, policy), which shows it the root "
                f"first, or name the block classes: TransformerBlockPolicy(block_classes="
                f"{{MyBlock}})"
            )
        return isinstance(module, self._detected)

    def __repr__(self) -> str:
        if self._block_classes is not None:
            names = ", ".join(cls.__name__ for cls in self._block_classes)
            return f"TransformerBlockPolicy(block_classes={{{names}}})"
        if self._detected is not None:
            return f"TransformerBlockPolicy(block_classes=None, detected={self._detected.__name__})"
        return "TransformerBlockPolicy(block_classes=None)"


def _detect(root: nn.Module) -> type[nn.Module]:
    found = require_block_list(root)
    logger.debug(
        "TransformerBlockPolicy: detected block class %s from %s (%d blocks, %d parameter "
        "elements)",
        found.block_class.__qualname__,
        repr(found.name) if found.name else "the model itself",
        found.num_blocks,
        found.numel,
    )
    return found.block_class


def _classes(given: ModuleClasses) -> tuple[type[nn.Module], ...]:
    """``given`` as a tuple of block classes, without duplicates, each one checked."""
    classes = as_module_classes(
        given,
        owner="TransformerBlockPolicy",
        argument="block_classes",
        example="MyBlock",
        none_means="detect the block class",
    )
    if not classes:
        raise WrapPlanError(
            "TransformerBlockPolicy: block_classes is empty, so no module would become a "
            "unit; name the block classes, e.g. block_classes={MyBlock}, or pass None to "
            "detect the block class"
        )
    for cls in classes:
        if issubclass(cls, _CONTAINERS):
            raise WrapPlanError(
                f"TransformerBlockPolicy: block_classes holds {cls.__name__}, which has no "
                f"forward, so it cannot be a unit; name the class of its entries instead"
            )
    return classes
