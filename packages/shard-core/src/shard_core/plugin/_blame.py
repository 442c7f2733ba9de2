"""Whose code raised: the plugin, the package or the user's module behind an exception.

shard calls code it did not write (a wrap policy's ``wrap()``, a policy
factory, a comm hook). When that code raises, the user must learn which
distribution to blame and what shard was doing, not just see a bare
``KeyError``. :func:`plugin_call_error` builds the error to raise ``from``
the original; see [Note: finding the code that raised].
"""

from __future__ import annotations

import functools
import importlib.metadata
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType

from shard_core.errors import PluginCallError
from shard_core.plugin import _manager
from shard_core.plugin._manager import ENV_DISABLE, PluginOrigin

__all__ = ["CodeOwner", "code_owner", "plugin_call_error", "safe_repr"]

# [Note: finding the code that raised]
# The frames of the original's traceback are read innermost first, and the
# first one that is neither shard's own packages (the layers under
# packages/), nor torch, pluggy or the standard library is the code to
# blame: a plugin's policy indexing a dict, the user's lambda inside
# LambdaWrapPolicy, the user's model that a plugin called. That module is
# then a plugin when an entry point of group "shard" lives in its top-level
# package (so the message can name the distribution and the entry point to
# block), a module of another installed distribution, or the user's own. When
# every frame is shard's or a library's, shard itself is to blame.

_SHARD_PACKAGES = frozenset(
    {"shard_checkpoint", "shard_cli", "shard_comms", "shard_core", "shard_runtime", "shard_testing"}
)
_LIBRARIES = frozenset({"pluggy", "torch"}) | sys.stdlib_module_names


@dataclass(frozen=True, slots=True)
class CodeOwner:
    """The code an exception came from.

    Attributes:
        module: The module of the frame that raised (see [Note: finding the code that raised]).
        location: ``file:line`` of that frame.
        plugin: The plugin that module belongs to, or ``None``.
        distribution: ``"name version"`` of the installed distribution that
            holds the module when it is not a plugin, or ``None`` (the user's code).
        is_shard: Whether the module is one of shard's own packages.
    """

    module: str
    location: str
    plugin: PluginOrigin | None = None
    distribution: str | None = None
    is_shard: bool = False

    def sentence(self) -> str:
        """Where the code is and what to do, as the last sentence of an error."""
        if self.plugin is not None:
            owner = self.plugin.distribution or "the plugin"
            return (
                f"It was raised in {self.plugin.describe()}, module {self.module!r}: report it to "
                f"the authors of {owner} with the traceback above, or block the plugin with "
                f"{ENV_DISABLE}={self.plugin.entry_point}"
            )
        if self.is_shard:
            return (
                f"It was raised inside {self.distribution} itself, module {self.module!r} "
                f"({self.location}): this is a bug in shard, please report it with the "
                f"traceback above"
            )
        if self.distribution is not None:
            return (
                f"It was raised in {self.distribution}, module {self.module!r} "
                f"({self.location}): see the original exception above"
            )
        return (
            f"It was raised in your code, module {self.module!r} ({self.location}): see the "
            f"original exception above"
        )


def plugin_call_error(exc: Exception, subject: str, context: str = "") -> PluginCallError:
    """The error to raise ``from exc`` when code shard called raised ``exc``.

    ``subject`` says whose method or object was called (``"wrap policy
    SizeWrapPolicy(...)"``), ``context`` what shard was doing, starting
    with a space (``" in wrap() for module 'layers.0' (Block)"``). The
    message ends with :meth:`CodeOwner.sentence`. The error is also an
    instance of ``exc``'s built-in category (see [Note: catching what a plugin
    raised] in ``shard_core.errors``). Callers re-raise a
    :class:`~shard_core.errors.ShardError` as it is instead.

    Example::

        try:
            decision = policy.wrap(module, name, numel)
        except ShardError:
            raise
        except Exception as exc:
            raise plugin_call_error(exc, f"wrap policy {safe_repr(policy)}", " in wrap()") from exc
    """
    owner = code_owner(exc.__traceback__)
    message = f"{subject} raised {type(exc).__name__}: {exc}{context}"
    if owner is not None:
        message += f". {owner.sentence()}"
    return PluginCallError.wrapping(exc, message)


def safe_repr(obj: object) -> str:
    """``repr(obj)``, or a placeholder when the object's ``__repr__`` raises."""
    try:
        return repr(obj)
    except Exception:
        return f"<{type(obj).__name__} object>"


def code_owner(tb: TracebackType | None) -> CodeOwner | None:
    """The code to blame for a traceback (see [Note: finding the code that raised])."""
    frames = list(traceback.walk_tb(tb))
    shard_frame = None
    for frame, lineno in reversed(frames):
        module = frame.f_globals.get("__name__") or "?"
        top = module.partition(".")[0]
        if top in _SHARD_PACKAGES:
            shard_frame = shard_frame or (frame, lineno)
            continue
        if top in _LIBRARIES:
            continue
        location = f"{frame.f_code.co_filename}:{lineno}"
        plugin = _plugin_of(top)
        if plugin is not None:
            return CodeOwner(module, location, plugin=plugin)
        return CodeOwner(module, location, distribution=_distribution_of(top))
    if shard_frame is None:
        return None
    frame, lineno = shard_frame
    module = frame.f_globals.get("__name__") or "?"
    location = f"{frame.f_code.co_filename}:{lineno}"
    distribution = _version_of(module.partition(".")[0].replace("_", "-"))
    return CodeOwner(module, location, distribution=distribution, is_shard=True)


def _plugin_of(top: str) -> PluginOrigin | None:
    """The entry point of group ``shard`` whose module lives in top-level package ``top``."""
    try:
        for entry_point in _manager._entry_points():
            if entry_point.module.partition(".")[0] == top:
                dist = entry_point.dist
                if dist is None:
                    return PluginOrigin(entry_point.name, None, None)
                return PluginOrigin(entry_point.name, dist.name, dist.version)
    except Exception:  # broken metadata must not hide the error being reported
        return None
    return None


def _distribution_of(top: str) -> str | None:
    """``"name version"`` of the installed distribution that provides package ``top``, if known."""
    try:
        names = _packages_distributions().get(top)
    except Exception:  # a broken distribution's metadata must not hide the real error
        return None
    return _version_of(names[0]) if names else None


@functools.lru_cache(maxsize=1)
def _packages_distributions() -> Mapping[str, list[str]]:
    # Reads every installed distribution's file list (a second or so in a large
    # environment), so once per process; this runs only when reporting an error.
    return importlib.metadata.packages_distributions()


def _version_of(distribution: str) -> str:
    try:
        return f"{distribution} {importlib.metadata.version(distribution)}"
    except importlib.metadata.PackageNotFoundError:
        return distribution
