"""The pytest plugin of shard-testing: the ``rank_pool`` fixture and ``--shard-pool-timeout``.

pytest loads this module in every session through the ``pytest11`` entry
point. The fixture is session-scoped: the pool's workers start on first use
and are stopped when the session ends, so no worker outlives pytest.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from shard_testing._pool import DEFAULT_TIMEOUT_S, RankPool

__all__ = ["pytest_addoption", "rank_pool"]


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register ``--shard-pool-timeout``."""
    group = parser.getgroup("shard-testing", "shard multi-rank tests")
    group.addoption(
        "--shard-pool-timeout",
        dest="shard_pool_timeout",
        type=_seconds,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=(
            "seconds a rank_pool.run(...) without its own timeout= may take before the ranks "
            f"are killed and RankTimeout is raised (default: {DEFAULT_TIMEOUT_S:g})"
        ),
    )


@pytest.fixture(scope="session")
def rank_pool(pytestconfig: pytest.Config) -> Iterator[RankPool]:
    """The session's pool of gloo ranks: ``rank_pool.run(fn, world_size, *args)``."""
    with RankPool(timeout=pytestconfig.getoption("shard_pool_timeout")) as pool:
        yield pool
