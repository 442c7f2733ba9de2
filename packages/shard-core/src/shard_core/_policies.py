"""The wrap policies built into shard-core.

Two ways of saying which modules become units cover most models: by class
(every transformer block) and by a function of the module. They are what
PyTorch offers under the same names, so a model's policy carries over with
its import line; the registry also offers them by name (``"module_class"``,
``"lambda"``) through the same hook third-party policies use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import nn

from shard_core.errors import WrapPlanError
from shard_core.protocols import WrapDecision

__all__ = [
    "CustomPolicy",
    "LambdaWrapPolicy",
    "ModuleClasses",
    "ModuleWrapPolicy",
    "as_module_classes",
]

ModuleClasses = type[nn.Module] | Iterable[type[nn.Module]]
"""One ``nn.Module`` class, or an iterable of them: how every policy takes classes."""


def as_module_classes(
    given: object, *, owner: str, argument: str, example: str, none_means: str | None = None
) -> tuple[type[nn.Module], ...]:
    """``given`` (a class or an iterable of classes) as a tuple, duplicates dropped, checked.

    Every policy that takes module classes (this module's, the size and
    transformer plugins', third parties') checks them the same way, so their
    errors read alike: ``{owner}: {argument} must ...``, ending with an
    example (``{argument}={{{example}}}``). ``none_means`` says what ``None``
    would have done, for policies that accept it (the caller handles
    ``None`` itself).

    Raises:
        WrapPlanError: ``given`` is neither a class nor an iterable (a string
            counts as neither), or holds something that is not an
            ``nn.Module`` subclass.
    """
    value = given
    if isinstance(value, type):
        value = (value,)
    elif isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        or_none = "" if none_means is None else " or None"
        then = "" if none_means is None else f", or None to {none_means}"
        raise WrapPlanError(
            f"{owner}: {argument} must be a set of nn.Module subclasses{or_none}, got "
            f"{value!r} ({type(value).__name__}); pass e.g. {argument}={{{example}}}{then}"
        )
    classes = tuple(dict.fromkeys(value))
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise WrapPlanError(
                f"{owner}: {argument} must hold nn.Module subclasses, got {cls!r} "
                f"({type(cls).__name__}); pass the class itself, e.g. {argument}={{{example}}}"
            )
    return classes


class ModuleWrapPolicy:
    """A module becomes a unit when it is an instance of one of ``module_classes``.

    ``module_classes`` is a module class or an iterable of them (subclasses
    match too, as with ``isinstance``). Registered as ``"module_class"``
    (option ``module_classes=``).
    """

    __slots__ = ("_module_classes",)

    def __init__(self, module_classes: ModuleClasses) -> None:
        self._module_classes = as_module_classes(
            module_classes,
            owner="ModuleWrapPolicy",
            argument="module_classes",
            example="TransformerBlock",
        )

    @property
    def module_classes(self) -> tuple[type[nn.Module], ...]:
        """The classes whose instances become units, without duplicates, in the order given."""
        return self._module_classes

    def descend(self, module: nn.Module, name: str) -> bool:
        return True

    def wrap(self, module: nn.Module, name: str, unwrapped_numel: int) -> WrapDecision:
        return isinstance(module, self._module_classes)

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        """PyTorch's functional form, ``policy(module, recurse, nonwrapped_numel)``.

        PyTorch's ``ModuleWrapPolicy`` can stand wherever a policy function
        does (inside ``_or_policy``, a user's own combinator), so ours can
        too: always descend, wrap instances of ``module_classes``; the
        parameter count is ignored.
        """
        return True if recurse else isinstance(module, self._module_classes)

    def __repr__(self) -> str:
        names = ", ".join(cls.__name__ for cls in self._module_classes)
        return f"ModuleWrapPolicy({{{names}}})"


class LambdaWrapPolicy:
    """A module becomes a unit when ``fn(module)`` says so.

    ``fn`` answers ``True``/``False``, or a mapping of keyword overrides for
    that unit (``{"reshard_after_forward": False}``); an empty mapping means
    "not a unit", as in PyTorch's ``CustomPolicy``. Registered as
    ``"lambda"`` (option ``fn=``).
    """

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[nn.Module], bool | Mapping[str, Any]]) -> None:
        if not callable(fn):
            raise WrapPlanError(
                f"{type(self).__name__}: expected a callable taking a module, "
                f"got {fn!r} ({type(fn).__name__})"
            )
        self._fn = fn

    def descend(self, module: nn.Module, name: str) -> bool:
        return True

    def wrap(self, module: nn.Module, name: str, unwrapped_numel: int) -> WrapDecision:
        decision = self._fn(module)
        if isinstance(decision, Mapping) and not decision:
            return False
        # Anything else is checked by the walker, which names the module.
        return decision

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._fn!r})"


class CustomPolicy(LambdaWrapPolicy):
    """PyTorch's ``CustomPolicy``: ``lambda_fn(module)`` answers a bool or per-unit overrides.

    The same policy as :class:`LambdaWrapPolicy`, under PyTorch's name and
    argument name, so ``CustomPolicy(lambda_fn)`` carries over unchanged.
    """

    __slots__ = ()

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | Mapping[str, Any]]) -> None:
        super().__init__(lambda_fn)
