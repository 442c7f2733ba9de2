"""Applying wrap policies: what a user may pass as a policy, and which units it makes.

Both front ends (``apply_wrap_policy`` for ``fully_shard``, ``auto_wrap_policy=``
for the wrapper) must turn the same policy into the same units, so they share
the two steps here: :func:`resolve_wrap_policy` turns every accepted way of
naming a policy into a :class:`~shard_core.protocols.WrapPolicy`, and
:func:`plan_units` runs shard-core's walker and then repairs what a policy
cannot see, parameters that alias each other landing in different units.

[Note: tied parameters across units]
A parameter used by two units cannot be sharded by both: the second unit
would find it already sharded (or, for two parameters sharing storage, shard
a copy, so the tie silently breaks and the weight trains twice). A policy
decides one module at a time and cannot know about ties, so the plan is
repaired afterwards: a parameter is *used* by the nearest unit above every
module that holds it, on every path from the root (a module reachable under
two names counts under both), and parameters alias when they are one object
or share storage. When one alias group is used by several units, the units
holding only part of it are dropped, those units and every unit between them
and the nearest unit above that contains all of them, so the group lands in
that unit (the root at worst). Folds repeat until no group is split.

[Note: PyTorch's policy functions]
PyTorch's wrapper also takes a policy as a function
``fn(module, recurse, nonwrapped_numel) -> bool``, usually one of the four in
``torch.distributed.fsdp.wrap`` bound with ``functools.partial``. Scripts
import those functions by name, so this module defines functions of the same
names, signatures and answers; :func:`resolve_wrap_policy` turns any such
function (theirs, ours or the user's) into a ``WrapPolicy``, so they work
with both front ends. ``enable_wrap``/``wrap`` are PyTorch's manual wrapping:
the model wraps its own layers while it builds them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Set
from dataclasses import dataclass, field, replace
from typing import Any, TypeAlias, TypeVar

from torch import nn
from torch.distributed.tensor import DTensor

from shard_core import ModuleWrapPolicy, Registry, WrapTarget, get_registry, plan_wraps
from shard_core.errors import WrapPlanError
from shard_core.protocols import WrapDecision, WrapPolicy
from shard_runtime._fully_shard import fully_shard

__all__ = [
    "WrapPolicyLike",
    "always_wrap_policy",
    "apply_wrap_policy",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "plan_units",
    "resolve_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]

_log = logging.getLogger("shard.runtime")

_M = TypeVar("_M", bound=nn.Module)

AutoWrapFn: TypeAlias = Callable[..., bool]
"""PyTorch's callable policy: ``fn(module=, recurse=, nonwrapped_numel=) -> bool``."""

WrapPolicyLike: TypeAlias = (
    WrapPolicy
    | str
    | tuple[str, Mapping[str, Any]]
    | type[nn.Module]
    | Iterable[type[nn.Module]]
    | AutoWrapFn
    | None
)
"""Every form :func:`resolve_wrap_policy` accepts."""

_ACCEPTED = (
    "None, a WrapPolicy (an object with descend() and wrap()), a registered policy name "
    "such as 'transformer', a (name, options) tuple such as ('size', {'min_num_params': "
    "10000}), a set of nn.Module classes, or PyTorch's callable policy fn(module, recurse, "
    "nonwrapped_numel) -> bool"
)

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)
"""Modules without a forward: never units (shard-core's walker refuses them)."""

_FULLY_SHARD_KWARGS = tuple(
    p.name
    for p in inspect.signature(fully_shard).parameters.values()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
)


# ---------------------------------------------------------------------- resolution


def resolve_wrap_policy(
    policy: WrapPolicyLike, *, registry: Registry | None = None
) -> WrapPolicy | None:
    """The :class:`~shard_core.protocols.WrapPolicy` that ``policy`` names.

    Accepts ``None`` (no policy: the root is the only unit); a ``WrapPolicy``
    (returned as is); a name registered in the plugin registry
    (``"transformer"``) or a ``(name, options)`` tuple
    (``("size", {"min_num_params": 10_000})``), built through ``registry``
    (default: :func:`shard_core.get_registry`); an ``nn.Module`` class or a
    set, frozenset, list or tuple of them (a
    :class:`~shard_core.ModuleWrapPolicy`); and PyTorch's callable policy
    ``fn(module, recurse, nonwrapped_numel) -> bool``
    (``functools.partial(size_based_auto_wrap_policy, min_num_params=...)``),
    asked with ``recurse=True`` and the subtree's parameter count whether to
    descend, and with ``recurse=False`` and the unclaimed count whether to wrap.

    Raises:
        WrapPlanError: ``policy`` is none of these (the message names its type
            and the accepted forms); a ``(name, options)`` tuple is malformed;
            a registered factory rejected the options.
        UnknownPluginNameError: no plugin registered the name (the message
            lists the registered names, or the distribution to install).
        PluginCollisionError: two plugins registered the name.
        PluginCallError: a registered factory raised (the message names the plugin).
    """
    if policy is None:
        return None
    if isinstance(policy, type):
        return _resolve_class(policy)
    if isinstance(policy, WrapPolicy):
        return policy
    if isinstance(policy, nn.Module):
        name = type(policy).__name__
        raise WrapPlanError(
            f"cannot use a {name} module as a wrap policy; to make every {name} a unit, pass "
            f"its class: {{{name}}}"
        )
    if isinstance(policy, str):
        return _from_registry(policy, {}, registry)
    if isinstance(policy, tuple) and policy and isinstance(policy[0], str):
        return _resolve_named_tuple(policy, registry)
    if isinstance(policy, (set, frozenset, list, tuple)):
        return ModuleWrapPolicy(policy)
    if callable(policy):
        return _AutoWrapFnPolicy(policy)
    raise WrapPlanError(_unsupported(policy))


def _resolve_class(cls: type) -> WrapPolicy:
    if issubclass(cls, nn.Module):
        return ModuleWrapPolicy(cls)
    if callable(getattr(cls, "descend", None)) and callable(getattr(cls, "wrap", None)):
        raise WrapPlanError(
            f"wrap policy {cls.__name__} is a class, not a policy; pass an instance: "
            f"{cls.__name__}(...)"
        )
    raise WrapPlanError(_unsupported(cls))


def _resolve_named_tuple(policy: tuple[Any, ...], registry: Registry | None) -> WrapPolicy:
    name = policy[0]
    if len(policy) != 2 or not (
        isinstance(policy[1], Mapping) and all(isinstance(k, str) for k in policy[1])
    ):
        raise WrapPlanError(
            f"wrap policy {policy!r}: a named policy with options is a (name, options) tuple "
            f"whose options are a mapping of keyword arguments, e.g. ('size', "
            f"{{'min_num_params': 10000}})"
        )
    return _from_registry(name, policy[1], registry)


def _from_registry(name: str, options: Mapping[str, Any], registry: Registry | None) -> WrapPolicy:
    # The registry checks the options against the factory's signature (a WrapPlanError
    # naming the policy, the options and those it takes) and names the plugin when the
    # factory raises, for every caller alike.
    registry = registry if registry is not None else get_registry()
    return registry.wrap_policy(name, **options)


def _unsupported(policy: object) -> str:
    message = f"cannot use {policy!r} ({type(policy).__name__}) as a wrap policy; pass {_ACCEPTED}"
    if type(policy).__module__.startswith("torch.distributed.fsdp"):
        message += (
            f". For PyTorch's {type(policy).__name__}, use shard's class of the same name "
            f"from shard_runtime (same arguments)"
        )
    return message


class _AutoWrapFnPolicy:
    """PyTorch's callable auto-wrap policy, asked the way PyTorch asks it.

    As in PyTorch's recursive wrap, a module the function refuses to descend
    into (``recurse=True`` answered falsy) is not asked again and never becomes
    a unit itself, its whole subtree staying with the unit above; and the
    answer for ``recurse=False`` counts by truthiness.
    """

    __slots__ = ("_fn", "_leaves")

    def __init__(self, fn: AutoWrapFn) -> None:
        try:
            inspect.signature(fn).bind(module=None, recurse=True, nonwrapped_numel=0)
        except TypeError as exc:
            raise WrapPlanError(
                f"wrap policy {fn!r} is callable but does not take PyTorch's auto-wrap "
                f"arguments (module, recurse, nonwrapped_numel): {exc}; for a function of the "
                f"module alone, pass CustomPolicy(fn)"
            ) from None
        except ValueError:  # no signature to check (a builtin); the call will tell
            pass
        self._fn = fn
        self._leaves: set[int] = set()

    def descend(self, module: nn.Module, name: str) -> bool:
        numel = sum(p.numel() for p in module.parameters())
        if self._fn(module=module, recurse=True, nonwrapped_numel=numel):
            self._leaves.discard(id(module))
            return True
        self._leaves.add(id(module))
        return False

    def wrap(self, module: nn.Module, name: str, unwrapped_numel: int) -> WrapDecision:
        if id(module) in self._leaves:
            return False
        if isinstance(module, _CONTAINERS) and unwrapped_numel == 0:
            # PyTorch wraps an emptied container too (``always_wrap_policy``), a unit
            # with nothing to gather; shard's units need a forward, so it stays a plain
            # container between its children's units.
            return False
        decision: object = self._fn(module=module, recurse=False, nonwrapped_numel=unwrapped_numel)
        if isinstance(decision, Mapping):
            return decision
        return bool(decision)

    def __repr__(self) -> str:
        fn = self._fn
        if isinstance(fn, functools.partial):
            args = ", ".join(f"{k}={v!r}" for k, v in fn.keywords.items())
            return f"AutoWrapFnPolicy({getattr(fn.func, '__name__', repr(fn.func))}, {args})"
        return f"AutoWrapFnPolicy({getattr(fn, '__name__', repr(fn))})"


# ---------------------------------------------------------------------- PyTorch's policy functions
# See [Note: PyTorch's policy functions].


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Every module becomes a unit of its own (PyTorch's ``always_wrap_policy``)."""
    return True


def lambda_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable[..., Any]
) -> bool:
    """A module becomes a unit when ``lambda_fn(module)`` is truthy; every subtree is entered.

    Bind ``lambda_fn`` with ``functools.partial`` to make it a policy.
    """
    if recurse:
        return True
    return lambda_fn(module)  # type: ignore[no-any-return]  # truthiness, as PyTorch's


def transformer_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    transformer_layer_cls: Set[type[nn.Module]],
) -> bool:
    """Every instance of a class in ``transformer_layer_cls`` becomes a unit.

    The policy for transformers: one unit per block, and whatever the blocks
    leave (embeddings, the head, tied weights) in the unit above. Bind
    ``transformer_layer_cls`` with ``functools.partial``.
    """
    if recurse:
        return True
    return isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: Set[type[nn.Module]] | None = None,
    exclude_wrap_modules: Set[type[nn.Module]] | None = None,
) -> bool:
    """A module becomes a unit once it holds ``min_num_params`` parameters no unit below claimed.

    Walking down, the subtree is entered only while it holds at least
    ``min_num_params`` and the module is not of a class in
    ``force_leaf_modules`` (default: the function's ``FORCE_LEAF_MODULES``,
    ``{nn.MultiheadAttention}``, whose forward reads its parameters
    directly); a module of a class in ``exclude_wrap_modules`` (default
    ``EXCLUDE_WRAP_MODULES``, the containers ``nn.ModuleList`` and
    ``nn.ModuleDict``, which have no forward) is never a unit. Bind the
    options with ``functools.partial``.
    """
    leaves = (
        size_based_auto_wrap_policy.FORCE_LEAF_MODULES  # type: ignore[attr-defined]
        if force_leaf_modules is None
        else force_leaf_modules
    )
    excluded = (
        size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES  # type: ignore[attr-defined]
        if exclude_wrap_modules is None
        else exclude_wrap_modules
    )
    is_large = nonwrapped_numel >= min_num_params
    if recurse:
        return is_large and not isinstance(module, tuple(leaves))
    return is_large and not isinstance(module, tuple(excluded))


size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {  # type: ignore[attr-defined]
    nn.ModuleList,
    nn.ModuleDict,
}
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- manual wrapping


@dataclass
class _WrapContext:
    """What ``enable_wrap`` set for ``wrap``: the wrapper class and its keyword arguments."""

    wrapper_cls: Callable[..., nn.Module] | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


_WRAP_CONTEXT = _WrapContext()


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Any, **wrapper_kwargs: Any) -> Iterator[None]:
    """Make :func:`wrap` wrap with ``wrapper_cls(module, **wrapper_kwargs)`` inside the block.

    For models that shard their large layers as they build them, so that the
    whole model never sits unsharded in memory. Outside the block ``wrap``
    returns the module as is, so one model class serves both.

    Raises:
        NotImplementedError: already inside an ``enable_wrap`` block (they do
            not nest; PyTorch's exception type).
    """
    if _WRAP_CONTEXT.wrapper_cls is not None:
        raise NotImplementedError(
            f"enable_wrap: already inside an enable_wrap block (wrapper_cls="
            f"{getattr(_WRAP_CONTEXT.wrapper_cls, '__name__', _WRAP_CONTEXT.wrapper_cls)}); "
            "blocks do not nest: pass per-module options to wrap(module, **overrides) instead"
        )
    if wrapper_cls is None:
        raise ValueError(
            "enable_wrap: wrapper_cls is None; pass the class to wrap with, e.g. "
            "enable_wrap(wrapper_cls=FullyShardedDataParallel)"
        )
    _WRAP_CONTEXT.wrapper_cls = wrapper_cls
    _WRAP_CONTEXT.kwargs = dict(wrapper_kwargs)
    try:
        yield
    finally:
        _WRAP_CONTEXT.wrapper_cls = None
        _WRAP_CONTEXT.kwargs = {}


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """``module`` wrapped with the class ``enable_wrap`` set, or ``module`` itself outside it.

    The arguments are ``enable_wrap``'s keyword arguments, then
    ``wrap_overrides``, then a ``_wrap_overrides`` mapping the module carries
    (PyTorch reads it too), each replacing the ones before.
    """
    wrapper_cls = _WRAP_CONTEXT.wrapper_cls
    if wrapper_cls is None:
        return module
    kwargs = {**_WRAP_CONTEXT.kwargs, **wrap_overrides}
    own = getattr(module, "_wrap_overrides", None)
    if isinstance(own, Mapping):
        kwargs = {**kwargs, **own}
    return wrapper_cls(module, **kwargs)


# ---------------------------------------------------------------------- planning


def plan_units(
    root: nn.Module,
    policy: WrapPolicy | None,
    *,
    ignored_modules: Iterable[nn.Module] = (),
    ignored_params: Iterable[nn.Parameter] | None = (),
) -> list[WrapTarget]:
    """The units of ``root`` under ``policy``, with tied parameters kept in one unit.

    :func:`shard_core.plan_wraps` (children before parents, the root last),
    then, while parameters that alias each other (one ``nn.Parameter`` under
    two names, or two sharing storage) are used by different units, the
    units holding part of such a group are dropped so that the group lands
    in the nearest unit above that contains all of it (the root at worst);
    that unit's ``numel`` grows by what the dropped units held. Each fold is
    logged at DEBUG on ``shard.runtime``. See [Note: tied parameters across units].

    Raises:
        WrapPlanError: as :func:`shard_core.plan_wraps`.
    """
    ignored_modules = list(ignored_modules)
    ignored_params = list(ignored_params or ())
    targets = plan_wraps(
        root, policy, ignored_modules=ignored_modules, ignored_params=ignored_params
    )
    ignored_module_ids = {id(m) for m in ignored_modules}
    ignored_param_ids = {id(p) for p in ignored_params}
    for module in ignored_modules:
        ignored_param_ids.update(id(p) for p in module.parameters())
    while True:
        split = _first_split_tie(root, targets, ignored_module_ids, ignored_param_ids)
        if split is None:
            return targets
        targets = _fold(targets, split)


@dataclass
class _AliasGroup:
    """Parameters that alias each other: their names and the units that use them."""

    names: dict[str, None] = field(default_factory=dict)
    unit_ids: dict[int, None] = field(default_factory=dict)


def _first_split_tie(
    root: nn.Module,
    targets: list[WrapTarget],
    ignored_module_ids: Set[int],
    ignored_param_ids: Set[int],
) -> _AliasGroup | None:
    """The first alias group (in ``root``'s module order) used by more than one unit."""
    unit_ids = {id(t.module) for t in targets}
    groups: dict[tuple[object, ...], _AliasGroup] = {}
    seen: set[tuple[int, int]] = set()

    # An explicit stack; see [Note: no recursive closures over parameters] in _module_tree.py.
    stack: list[tuple[nn.Module, str, int]] = [(root, "", id(root))]
    while stack:
        module, name, unit_id = stack.pop()
        if id(module) in unit_ids:
            unit_id = id(module)
        if (id(module), unit_id) in seen:  # same subtree under the same unit: nothing new
            continue
        seen.add((id(module), unit_id))
        for param_name, param in module.named_parameters(
            prefix=name, recurse=False, remove_duplicate=False
        ):
            if id(param) in ignored_param_ids:
                continue
            group = groups.setdefault(_alias_key(param), _AliasGroup())
            group.names[param_name] = None
            group.unit_ids[unit_id] = None
        children = [
            (child, f"{name}.{child_name}" if name else child_name, unit_id)
            for child_name, child in module.named_children()
            if id(child) not in ignored_module_ids
        ]
        stack.extend(reversed(children))  # the first child next: the order of a recursion
    return next((g for g in groups.values() if len(g.unit_ids) > 1), None)


def _alias_key(param: nn.Parameter) -> tuple[object, ...]:
    """Equal for parameters that are one object or share storage."""
    if not isinstance(param, DTensor) and param.device.type != "meta":
        ptr = param.untyped_storage().data_ptr()
        if ptr != 0:  # empty storages all sit at 0
            return ("storage", param.device, ptr)
    return ("object", id(param))


def _fold(targets: list[WrapTarget], group: _AliasGroup) -> list[WrapTarget]:
    """``targets`` without the units that hold part of ``group`` below its common unit."""
    by_id = {id(t.module): t for t in targets}
    users = [by_id[uid] for uid in group.unit_ids]
    keep = max(
        (t for t in targets if all(_contains(t.name, u.name) for u in users)),
        key=lambda t: len(t.name),
    )
    dropped = [
        t
        for t in targets
        if t is not keep
        and _contains(keep.name, t.name)
        and any(_contains(t.name, u.name) for u in users)
    ]
    _log.debug(
        "tied parameters %s would be split across units %s; dropped units %s so that unit %s "
        "holds them all",
        ", ".join(repr(n) for n in group.names),
        ", ".join(repr(u.name) for u in users),
        ", ".join(repr(t.name) for t in dropped),
        repr(keep.name),
    )
    dropped_ids = {id(t) for t in dropped}
    moved = sum(t.numel for t in dropped)
    return [
        replace(t, numel=t.numel + moved) if t is keep else t
        for t in targets
        if id(t) not in dropped_ids
    ]


def _contains(outer: str, inner: str) -> bool:
    """Whether the module named ``inner`` is ``outer`` or lies under it."""
    return outer == "" or inner == outer or inner.startswith(outer + ".")


# ---------------------------------------------------------------------- applying


def apply_wrap_policy(model: _M, policy: WrapPolicyLike, **fully_shard_kwargs: Any) -> _M:
    """Shard ``model`` with ``fully_shard`` on every unit ``policy`` makes, bottom-up.

    ``fully_shard``'s auto-wrap: :func:`resolve_wrap_policy` then
    :func:`plan_units` (honoring ``ignored_params``), then one
    ``fully_shard(unit, **fully_shard_kwargs)`` per unit, children before
    parents and the root last, with the overrides the policy returned for a
    unit (``CustomPolicy``) replacing the caller's keyword arguments for that
    unit only.

    Returns:
        ``model`` itself, now sharded.

    Raises:
        TypeError: a keyword argument ``fully_shard`` does not take.
        WrapPlanError: as :func:`resolve_wrap_policy` and :func:`plan_units`;
            a unit's overrides name an argument ``fully_shard`` does not take.
            Checked before any module is sharded.
    """
    unknown = [k for k in fully_shard_kwargs if k not in _FULLY_SHARD_KWARGS]
    if unknown:
        raise TypeError(
            f"apply_wrap_policy() got keyword arguments fully_shard does not take: "
            f"{', '.join(unknown)}; it takes {', '.join(_FULLY_SHARD_KWARGS)}"
        )
    targets = plan_units(
        model,
        resolve_wrap_policy(policy),
        ignored_params=fully_shard_kwargs.get("ignored_params"),
    )
    for target in targets:
        bad = [k for k in target.overrides if k not in _FULLY_SHARD_KWARGS]
        if bad:
            raise WrapPlanError(
                f"wrap policy answered overrides {dict(target.overrides)!r} for module "
                f"{target.name!r} ({type(target.module).__name__}), but fully_shard does not "
                f"take {', '.join(bad)}; overrides may name {', '.join(_FULLY_SHARD_KWARGS)}"
            )
    for target in targets:
        fully_shard(target.module, **{**fully_shard_kwargs, **target.overrides})
    return model
