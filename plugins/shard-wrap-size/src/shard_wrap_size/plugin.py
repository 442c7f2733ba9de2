"""Registry hooks of this plugin.

shard finds this module through the entry point declared in pyproject.toml
(group ``shard``) and registers the functions marked with ``hookimpl``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from shard_core import hookimpl
from shard_core.protocols import WrapPolicy
from shard_wrap_size._policy import SizeWrapPolicy

__all__ = ["shard_wrap_policies"]


@hookimpl
def shard_wrap_policies() -> Mapping[str, Callable[..., WrapPolicy]]:
    """Offer ``"size"``: ``wrap_policy("size", min_num_params=1_000_000)``."""
    return {"size": SizeWrapPolicy}
