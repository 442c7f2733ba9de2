"""Tests of the public surface of shard_testing."""

from __future__ import annotations

import shard_testing


def test_all_is_sorted_and_complete() -> None:
    """__all__ is sorted, and lists exactly the pool, its failures and the reference helpers."""
    assert shard_testing.__all__ == sorted(shard_testing.__all__)
    assert shard_testing.__all__ == [
        "Batch",
        "RankFailure",
        "RankPool",
        "RankTimeout",
        "ReferenceRun",
        "__version__",
        "assert_state_dicts_equal",
        "global_batch",
        "make_batches",
        "train_reference",
    ]
    for name in shard_testing.__all__:
        assert getattr(shard_testing, name) is not None


def test_failures_are_assertion_errors() -> None:
    """RankFailure and RankTimeout are AssertionErrors, so pytest reports them as test failures."""
    assert issubclass(shard_testing.RankFailure, AssertionError)
    assert issubclass(shard_testing.RankTimeout, AssertionError)
    assert not issubclass(shard_testing.RankTimeout, shard_testing.RankFailure)
    assert shard_testing.RankFailure.__module__ == "shard_testing"


def test_version_is_a_string() -> None:
    """The package exposes its version."""
    assert shard_testing.__version__ == "0.1.0"
