"""The ``"name_pattern"`` wrap policy: units chosen by the modules' qualified names.

Naming units by where they sit in the model (``layers.3``, ``encoder.blocks.0``)
needs no knowledge of their classes, which is handy for models one did not
write; it is also the smallest useful wrap policy, which is why it is the
example of a third-party plugin.
"""

from __future__ import annotations

import re

from torch import nn

from shard_core.errors import WrapPlanError

__all__ = ["NamePatternPolicy"]


class NamePatternPolicy:
    """A module becomes a unit when ``re.fullmatch(pattern, qualified_name)`` matches.

    ``pattern`` is a regular expression matched against the whole qualified
    name (``r"layers\\.\\d+"`` matches ``layers.0`` but not ``layers.0.mlp``).
    Registered as ``"name_pattern"`` (option ``pattern=``). A pattern that is
    not a string or not a valid regular expression raises
    :class:`~shard_core.errors.WrapPlanError`, like every bad policy option.
    """

    __slots__ = ("_regex",)

    def __init__(self, pattern: str) -> None:
        if not isinstance(pattern, str):
            raise WrapPlanError(
                f"name_pattern: pattern must be a str (a regular expression), "
                f"got {pattern!r} ({type(pattern).__name__})"
            )
        try:
            self._regex = re.compile(pattern)
        except re.error as exc:
            raise WrapPlanError(
                f"name_pattern: pattern {pattern!r} is not a valid regular expression: {exc}"
            ) from exc

    @property
    def pattern(self) -> str:
        """The regular expression, as given."""
        return self._regex.pattern

    def descend(self, module: nn.Module, name: str) -> bool:
        return True

    def wrap(self, module: nn.Module, name: str, unwrapped_numel: int) -> bool:
        return self._regex.fullmatch(name) is not None

    def __repr__(self) -> str:
        return f"NamePatternPolicy({self.pattern!r})"
