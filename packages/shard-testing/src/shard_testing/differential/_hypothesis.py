"""Hypothesis's strategy of differential configurations, for the CI sample and ``tools/fuzz``.

The tests and the fuzzer draw through this one adapter, so both explore
(and shrink over) the same space the same way. Hypothesis is imported when
the strategy is built, not with the package: shard-testing works without
it, and its ``hypothesis`` extra brings it for those who draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

from shard_testing.differential._config import Config, draw_config

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

__all__ = ["config_strategy"]

T = TypeVar("T")


def config_strategy(world_sizes: Sequence[int] = (2, 4)) -> SearchStrategy[Config]:
    """Configurations on ``world_sizes`` ranks, shrinking towards the simplest.

    Every choice of :func:`draw_config` is a ``sampled_from``, which shrinks
    to its first option; see [Note: Drawing configurations].

    Raises:
        ImportError: hypothesis is not installed (the message names the extra).
    """
    try:
        from hypothesis import strategies as st
    except ImportError as exc:
        raise ImportError(
            "config_strategy needs the hypothesis package, which is not installed: "
            "pip install hypothesis, or from a shard checkout "
            "pip install './packages/shard-testing[hypothesis]'"
        ) from exc

    @st.composite
    def build(draw: st.DrawFn) -> Config:
        def pick(options: Sequence[T], /) -> T:
            return draw(st.sampled_from(options))

        return draw_config(pick, world_sizes=tuple(world_sizes))

    return build()
