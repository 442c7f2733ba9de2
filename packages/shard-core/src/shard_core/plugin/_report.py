"""Showing a :class:`PluginWarning`: once, on one rank per host, at the user's line.

A bad plugin is reported where the user can act on it. Three things make
that so; see [Note: where plugin warnings show].
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Mapping

from shard_core.errors import PluginWarning

__all__ = ["emit", "is_shard_frame", "shows_warnings_here"]

logger = logging.getLogger("shard.plugin")

# [Note: where plugin warnings show]
# - Once per process: each plugin manager remembers the messages it showed
#   (ShardPluginManager.warn), and the process has one manager, so a bad
#   plugin met by every lookup is reported once, not per call.
# - Once per host, not per rank: torchrun starts one process per device, and
#   each would repeat every warning (12 lines for 6 bad plugins on 2 ranks).
#   Only local rank 0 of each host shows them: LOCAL_RANK as torchrun sets
#   it; without it RANK (then only global rank 0 shows them), and without
#   either the rank of an initialised default process group. Per host rather
#   than rank 0 of the job because plugins are installed per host: a plugin
#   that fails to import on one host only must still be reported. The other
#   ranks log the message at DEBUG on "shard.plugin" (SHARD_TRACE_PLUGINS=1
#   prints it), so nothing is lost.
# - At the user's line: the warning's location is the first frame outside
#   shard's packages (shard, shard_*: the layers and the plugins), pluggy,
#   importlib's loading machinery, contextlib/functools and torch (a lookup
#   made from a module's forward passes through torch's __call__). A warning
#   filter or a "-W error" therefore matches the user's module and the
#   printed line is the user's call, not shard's _manager.py.

_NOT_THE_CALLER = frozenset({"contextlib", "functools", "importlib", "pluggy", "torch"})


def is_shard_frame(module_name: str) -> bool:
    """Whether a frame of ``module_name`` is shard's or the machinery shard calls through."""
    top = module_name.partition(".")[0]
    return top == "shard" or top.startswith("shard_") or top in _NOT_THE_CALLER


def shows_warnings_here(environ: Mapping[str, str]) -> bool:
    """Whether this process is the one of its host that shows plugin warnings.

    See [Note: where plugin warnings show].
    """
    for variable in ("LOCAL_RANK", "RANK"):
        value = environ.get(variable, "").strip()
        if value:
            try:
                return int(value) == 0
            except ValueError:
                return True  # not a launcher's rank: show rather than hide
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return True


def emit(message: str, environ: Mapping[str, str]) -> None:
    """Warn ``message`` as a :class:`PluginWarning` at the caller's line, or log it on other ranks.

    Callers deduplicate; see :meth:`ShardPluginManager.warn`.
    """
    if not shows_warnings_here(environ):
        logger.debug("PluginWarning (shown by local rank 0): %s", message)
        return
    warnings.warn(message, PluginWarning, stacklevel=_caller_stacklevel())


def _caller_stacklevel() -> int:
    """``stacklevel`` for a ``warnings.warn`` in :func:`emit`: the first frame outside shard."""
    frame = sys._getframe(2)  # 0: this function, 1: emit, 2: emit's caller (stacklevel 2)
    level = 2
    while is_shard_frame(frame.f_globals.get("__name__") or "") and frame.f_back is not None:
        frame = frame.f_back
        level += 1
    return level
