"""Tests of the pytest plugin: the session-scoped rank_pool fixture and --shard-pool-timeout."""

from __future__ import annotations

import os

import pytest

pytest_plugins = ["pytester"]

_INNER_TESTS = """
SEEN = []


def test_first(rank_pool):
    SEEN.append(rank_pool)
    assert rank_pool.timeout == {timeout}
    assert rank_pool.world_sizes == ()


def test_second(rank_pool):
    assert rank_pool is SEEN[0]
"""


@pytest.mark.parametrize(("args", "timeout"), [([], 120.0), (["--shard-pool-timeout=7.5"], 7.5)])
def test_rank_pool_fixture_is_one_pool_per_session_with_the_option_timeout(
    pytester: pytest.Pytester, args: list[str], timeout: float
) -> None:
    """Every test of a session gets the same pool, whose default timeout is the option's."""
    pytester.makepyfile(_INNER_TESTS.format(timeout=timeout))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", *args)
    result.assert_outcomes(passed=2)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", "a number of seconds > 0"),
        ("-3", "a number of seconds > 0"),
        ("soon", "a number of seconds"),
    ],
)
def test_shard_pool_timeout_rejects_values_that_are_not_positive_seconds(
    pytester: pytest.Pytester, value: str, expected: str
) -> None:
    """A timeout that is not a positive number is a usage error naming the value."""
    result = pytester.runpytest_inprocess(f"--shard-pool-timeout={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"*argument --shard-pool-timeout: expected {expected}, got '{value}'"]
    )


def test_shard_pool_timeout_is_documented_in_help(pytester: pytest.Pytester) -> None:
    """pytest --help lists the option under the shard-testing group."""
    result = pytester.runpytest_inprocess("--help")
    result.stdout.fnmatch_lines(["shard multi-rank tests:", "*--shard-pool-timeout=SECONDS*"])


_PID_RECORDING_TEST = """
import os


def test_records_the_worker_pid(rank_pool):
    with open({path!r}, "w") as file:
        file.write(str(rank_pool.run(os.getpid, 1)[0]))
"""


def test_workers_are_gone_when_the_session_ends(pytester: pytest.Pytester) -> None:
    """A worker started by a session's rank_pool no longer exists once that session is over."""
    path = pytester.path / "pid.txt"
    pytester.makepyfile(_PID_RECORDING_TEST.format(path=str(path)))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    pid = int(path.read_text())
    assert pid != os.getpid()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
