"""The wrap-policy walker: which submodules of a model become units.

The runtime (before it shards anything) and ``shard plan`` (which never
shards) must agree exactly on the units of a model, so the walk is one pure
function over the module tree: it asks a :class:`~shard_core.protocols.WrapPolicy`
about each module, bottom-up, and returns the plan without touching the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from torch import nn

from shard_core.errors import ShardError, WrapPlanError
from shard_core.plugin._blame import plugin_call_error, safe_repr
from shard_core.protocols import WrapPolicy

# WrapPlanError lives in shard_core.errors; re-exported here for old imports.
__all__ = ["WrapPlanError", "WrapTarget", "plan_wraps"]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


@dataclass(frozen=True, slots=True)
class WrapTarget:
    """One unit of a wrap plan.

    Attributes:
        name: Qualified name of the module (``"layers.0"``); ``""`` for the root.
        module: The module that becomes a unit.
        overrides: Keyword arguments that replace the caller's for this unit
            only (what a policy returned as a mapping); empty when the policy
            answered ``True``.
        numel: Number of parameter elements the unit manages: those in its
            subtree that no unit below it claimed, shared parameters counted
            once, ignored parameters left out.
    """

    name: str
    module: nn.Module
    overrides: Mapping[str, Any]
    numel: int


def plan_wraps(
    root: nn.Module,
    policy: WrapPolicy | None,
    *,
    ignored_modules: Iterable[nn.Module] = (),
    ignored_params: Iterable[nn.Parameter] = (),
) -> list[WrapTarget]:
    """The units ``policy`` makes of ``root``, children before parents, the root last.

    Modules are visited in post-order, following ``named_children``; a module
    reachable under two names is visited once, under the first. Where
    ``policy.descend`` answers ``False`` the walker does not enter the
    subtree: the module itself is still asked, with all of its subtree's
    unclaimed parameters. A module that becomes a unit claims its unclaimed
    parameters, so units above it do not count them. The root is always a
    unit, with the overrides the policy returned for it if it returned a
    mapping. ``ignored_modules`` (with their subtrees) are never visited and
    their parameters, like ``ignored_params``, are never counted. With
    ``policy=None`` the root is the only unit.

    A policy is code shard did not write: an exception its ``descend`` or
    ``wrap`` raises is re-raised as a
    :class:`~shard_core.errors.PluginCallError` naming the policy, the
    module's qualified name, and the plugin, package or module whose code
    raised (a :class:`~shard_core.errors.ShardError` passes unchanged: it
    names the culprit already).

    Raises:
        WrapPlanError: the policy chose a ``ModuleList``/``ModuleDict`` (or
            the root is one): a container has no forward, so its children
            must be the units; the policy answered something other than a
            bool or a mapping with string keys; ``root`` is ignored;
            ``policy`` is not a :class:`~shard_core.protocols.WrapPolicy`.
        PluginCallError: the policy raised; also an instance of the original
            exception's built-in category (a ``KeyError`` stays a ``KeyError``).
    """
    if policy is not None and not isinstance(policy, WrapPolicy):
        raise WrapPlanError(
            f"policy must be a WrapPolicy (an object with descend() and wrap()) or None, "
            f"got {type(policy).__name__}; registered policies are built with "
            f"shard_core.get_registry().wrap_policy(name, **options)"
        )
    ignored_module_ids = {id(m) for m in ignored_modules}
    if id(root) in ignored_module_ids:
        raise WrapPlanError(
            f"the root module ({type(root).__name__}) is in ignored_modules; "
            f"the root is always a unit: remove it from ignored_modules"
        )
    ignored_param_ids = {id(p) for p in ignored_params}
    for module in root.modules():
        if id(module) in ignored_module_ids:
            ignored_param_ids.update(id(p) for p in module.parameters())
    walker = _Walker(root, policy, ignored_module_ids, ignored_param_ids)
    walker.visit(root, "")
    return walker.targets


class _Walker:
    """The state of one walk: what is visited, what is claimed, the units so far."""

    def __init__(
        self,
        root: nn.Module,
        policy: WrapPolicy | None,
        ignored_module_ids: set[int],
        ignored_param_ids: set[int],
    ) -> None:
        self.root = root
        self.policy = policy
        self.ignored_module_ids = ignored_module_ids
        self.ignored_param_ids = ignored_param_ids
        self.visited: set[int] = {id(root)}
        self.claimed: set[int] = set()
        self.targets: list[WrapTarget] = []

    def visit(self, module: nn.Module, name: str) -> dict[int, nn.Parameter]:
        """Walk ``module``'s subtree; return its parameters no unit claimed, by id."""
        unclaimed: dict[int, nn.Parameter] = {}
        if self.policy is None or self._ask("descend", module, name):
            for child_name, child in module.named_children():
                if id(child) in self.ignored_module_ids or id(child) in self.visited:
                    continue
                self.visited.add(id(child))
                unclaimed.update(self.visit(child, f"{name}.{child_name}" if name else child_name))
            own = module.parameters(recurse=False)
        else:
            self.visited.update(id(m) for m in module.modules())
            own = module.parameters()
        for param in own:
            if id(param) not in self.ignored_param_ids:
                unclaimed[id(param)] = param
        # A sibling visited later may have claimed a parameter shared with this subtree.
        unclaimed = {pid: p for pid, p in unclaimed.items() if pid not in self.claimed}
        numel = sum(p.numel() for p in unclaimed.values())

        overrides: Mapping[str, Any] | None = None
        if self.policy is not None:
            overrides = self._overrides(self._ask("wrap", module, name, numel), module, name)
        is_root = module is self.root
        if overrides is None and not is_root:
            return unclaimed
        if isinstance(module, _CONTAINERS):
            raise WrapPlanError(self._container_message(module, name, is_root))
        self.claimed.update(unclaimed)
        self.targets.append(
            WrapTarget(
                name=name,
                module=module,
                overrides=MappingProxyType(dict(overrides or {})),
                numel=numel,
            )
        )
        return {}

    def _ask(self, method: str, module: nn.Module, name: str, *args: object) -> object:
        """``policy.descend(...)`` or ``policy.wrap(...)``; see plan_wraps for its exceptions."""
        try:
            return getattr(self.policy, method)(module, name, *args)
        except ShardError:
            raise
        except Exception as exc:
            raise plugin_call_error(
                exc,
                f"wrap policy {safe_repr(self.policy)}",
                f" in {method}() for module {_display(name)} ({type(module).__name__})",
            ) from exc

    def _overrides(
        self, decision: object, module: nn.Module, name: str
    ) -> Mapping[str, Any] | None:
        """``None`` when ``decision`` says "no unit", else the unit's overrides."""
        if isinstance(decision, bool):
            return {} if decision else None
        if isinstance(decision, Mapping) and all(isinstance(k, str) for k in decision):
            return decision
        raise WrapPlanError(
            f"wrap policy {safe_repr(self.policy)} answered {decision!r} "
            f"({type(decision).__name__}) for module {_display(name)} ({type(module).__name__}); "
            f"a wrap policy answers True, False, or a mapping of keyword overrides with string keys"
        )

    def _container_message(self, module: nn.Module, name: str, is_root: bool) -> str:
        kind = type(module).__name__
        why = "is the root, which is always a unit" if is_root else "was chosen by the wrap policy"
        return (
            f"module {_display(name)} ({kind}) {why}, but a {kind} has no forward, so it "
            f"cannot be a unit; wrap its children instead (name their class in the policy, "
            f"or make each child a unit)"
        )


def _display(name: str) -> str:
    return repr(name) if name else "'' (the root)"
