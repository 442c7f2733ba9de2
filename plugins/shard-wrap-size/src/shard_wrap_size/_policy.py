"""The ``"size"`` wrap policy: units chosen by parameter count.

A model one did not write, or one with no repeated block, can still be split
into units of a useful size: walking bottom-up, a module becomes a unit as
soon as the parameters no unit below it has claimed reach a threshold. This
is PyTorch's ``size_based_auto_wrap_policy`` under the same argument names,
so a policy carries over with its import line.
"""

from __future__ import annotations

from numbers import Integral

from torch import nn

from shard_core import ModuleClasses, WrapPlanError, as_module_classes

__all__ = ["DEFAULT_EXCLUDE_WRAP_MODULES", "DEFAULT_FORCE_LEAF_MODULES", "SizeWrapPolicy"]

DEFAULT_FORCE_LEAF_MODULES: frozenset[type[nn.Module]] = frozenset({nn.MultiheadAttention})
"""Leaf classes (never units, never entered), when ``force_leaf_modules`` is ``None``."""

DEFAULT_EXCLUDE_WRAP_MODULES: frozenset[type[nn.Module]] = frozenset({nn.ModuleList, nn.ModuleDict})
"""Classes that never become units, when ``exclude_wrap_modules`` is ``None``."""

# [Note: containers are never units]
# A ModuleList or ModuleDict has no forward, so the engine could never gather
# its parameters before they are used; the walker refuses such a unit. The
# default exclude set names both, as PyTorch's does; a caller who passes their
# own set replaces the default, and would then get the walker's error for the
# first large container instead of a plan. Containers are therefore always
# excluded, whatever set is given: their children become the units instead.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


class SizeWrapPolicy:
    """A module becomes a unit when its unclaimed parameters reach ``min_num_params``.

    Walking children before parents, a module's *unclaimed* parameters are
    those of its subtree that no unit below it took (shared parameters
    counted once). Instances of ``exclude_wrap_modules`` never become units
    (``ModuleList`` and ``ModuleDict`` never do, see [Note: containers are
    never units]). Instances of ``force_leaf_modules`` are leaves: neither
    they nor their submodules become units, their parameters stay with the
    nearest unit above (``MultiheadAttention`` reads its submodules'
    parameters directly, so those cannot be units of their own); this is
    what PyTorch does. The root is always a unit. Registered as ``"size"``.

    Args:
        min_num_params: The threshold, in parameter elements; ``0`` makes
            every module that is not excluded a unit.
        force_leaf_modules: Module classes (or one class) that are leaves:
            never units, their subtrees never entered; ``None`` means
            :data:`DEFAULT_FORCE_LEAF_MODULES`.
        exclude_wrap_modules: Module classes (or one class) that never become
            units; ``None`` means :data:`DEFAULT_EXCLUDE_WRAP_MODULES`.

    Raises:
        WrapPlanError: ``min_num_params`` is not a non-negative int; a class
            set holds something that is not an ``nn.Module`` subclass.
    """

    __slots__ = (
        "_exclude_wrap_modules",
        "_force_leaf_modules",
        "_leaves",
        "_min_num_params",
        "_never_units",
    )

    def __init__(
        self,
        min_num_params: int = 100_000_000,
        force_leaf_modules: ModuleClasses | None = None,
        exclude_wrap_modules: ModuleClasses | None = None,
    ) -> None:
        threshold: object = min_num_params  # checked as what a caller may really pass
        if isinstance(threshold, bool) or not isinstance(threshold, Integral):
            raise WrapPlanError(
                f"SizeWrapPolicy: min_num_params must be an int, got {threshold!r} "
                f"({type(threshold).__name__}); pass a whole number of parameter "
                f"elements, e.g. min_num_params=int(1e8)"
            )
        if threshold < 0:
            raise WrapPlanError(
                f"SizeWrapPolicy: min_num_params must be >= 0, got {threshold}; it is "
                f"the number of parameter elements at which a module becomes a unit"
            )
        self._min_num_params: int = int(threshold)
        self._force_leaf_modules: frozenset[type[nn.Module]] = _classes(
            "force_leaf_modules", force_leaf_modules, DEFAULT_FORCE_LEAF_MODULES
        )
        self._exclude_wrap_modules: frozenset[type[nn.Module]] = _classes(
            "exclude_wrap_modules", exclude_wrap_modules, DEFAULT_EXCLUDE_WRAP_MODULES
        )
        self._leaves: tuple[type[nn.Module], ...] = tuple(self._force_leaf_modules)
        # See [Note: containers are never units]
        self._never_units: tuple[type[nn.Module], ...] = (
            *_CONTAINERS,
            *self._exclude_wrap_modules,
            *self._force_leaf_modules,
        )

    @property
    def min_num_params(self) -> int:
        """The threshold, in parameter elements."""
        return self._min_num_params

    @property
    def force_leaf_modules(self) -> frozenset[type[nn.Module]]:
        """The classes that are leaves: neither they nor their submodules become units."""
        return self._force_leaf_modules

    @property
    def exclude_wrap_modules(self) -> frozenset[type[nn.Module]]:
        """The classes that never become units (``ModuleList``/``ModuleDict`` never do anyway)."""
        return self._exclude_wrap_modules

    def descend(self, module: nn.Module, name: str) -> bool:
        return not isinstance(module, self._leaves)

    def wrap(self, module: nn.Module, name: str, unwrapped_numel: int) -> bool:
        if isinstance(module, self._never_units):
            return False
        return unwrapped_numel >= self._min_num_params

    def __repr__(self) -> str:
        return (
            f"SizeWrapPolicy(min_num_params={self._min_num_params}, "
            f"force_leaf_modules={_show(self._force_leaf_modules)}, "
            f"exclude_wrap_modules={_show(self._exclude_wrap_modules)})"
        )


def _classes(
    argument: str, given: ModuleClasses | None, default: frozenset[type[nn.Module]]
) -> frozenset[type[nn.Module]]:
    """``given`` as a set of module classes (``default`` for ``None``), each one checked."""
    if given is None:
        return default
    return frozenset(
        as_module_classes(
            given, owner="SizeWrapPolicy", argument=argument, example="nn.MultiheadAttention"
        )
    )


def _show(classes: frozenset[type[nn.Module]]) -> str:
    if not classes:
        return "set()"
    return "{" + ", ".join(sorted(cls.__name__ for cls in classes)) + "}"
