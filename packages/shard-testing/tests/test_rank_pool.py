"""Tests of RankPool: collectives through gloo, results, failures, timeouts, reuse and resets."""

from __future__ import annotations

import importlib.util
import operator
import os
import resource
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

from shard_testing import RankFailure, RankPool, RankTimeout, make_batches

# Functions below run on the ranks; each is module-level so the ranks can find it.


def _shard_of(rank: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) + 100.0 * rank


def _unsharded_of(rank: int, world_size: int, numel: int) -> torch.Tensor:
    return torch.arange(world_size * numel, dtype=torch.float32) * (rank + 1)


def _all_gather_and_reduce_scatter(numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    gathered = torch.empty(world_size * numel)
    dist.all_gather_into_tensor(gathered, _shard_of(rank, numel))
    reduced = torch.empty(numel)
    dist.reduce_scatter_tensor(reduced, _unsharded_of(rank, world_size, numel))
    return gathered, reduced


def _raise_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")
    return dist.get_rank()


def _fail_on_rank_one_while_rank_zero_waits() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("rank one gives up")
    dist.barrier()


def _sleep_on_last_rank(seconds: float) -> int:
    if dist.get_rank() == dist.get_world_size() - 1:
        time.sleep(seconds)
    return dist.get_rank()


def _exit_on_rank_one(code: int) -> int:
    if dist.get_rank() == 1:
        print("rank one leaves now", flush=True)
        os._exit(code)
    return dist.get_rank()


def _segfault() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the working directory
    os.kill(os.getpid(), signal.SIGSEGV)


def _tensors() -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    base = torch.arange(12, dtype=torch.float64).reshape(3, 4) + rank
    return {
        "float64": base,
        "view": base[1:, ::2],
        "int64": torch.tensor([rank, -rank]),
        "bool": torch.tensor([True, rank % 2 == 1]),
        "parameter": torch.nn.Parameter(torch.full((2,), float(rank))),
        "non_leaf": torch.ones(2, requires_grad=True) * 3.0,
        "large": torch.arange(1_000_000, dtype=torch.float32) * (rank + 1),
    }


def _environment() -> dict[str, object]:
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
    return {
        **{name: os.environ[name] for name in names},
        "master_port": os.environ["MASTER_PORT"],
        "backend": dist.get_backend(),
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "threads": torch.get_num_threads(),
    }


def _change_state(directory: str) -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    os.environ["SHARD_TESTING_LEFTOVER"] = "1"
    os.chdir(directory)


def _observe_state() -> tuple[torch.dtype, bool, int, bool, str]:
    return (
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
        torch.get_num_threads(),
        "SHARD_TESTING_LEFTOVER" in os.environ,
        os.getcwd(),
    )


def _warn() -> int:
    warnings.warn("a warning from the ranks", UserWarning, stacklevel=1)
    return dist.get_rank()


@dataclass(frozen=True)
class _Scale:
    factor: float


def _scaled(scale: _Scale) -> _Scale:
    return _Scale(scale.factor * (dist.get_rank() + 1))


def _make_one(generator: torch.Generator, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = torch.rand(batch_size, 2, generator=generator)
    return inputs, torch.rand(batch_size, generator=generator)


def _unpicklable_result() -> object:
    return threading.Lock()


def _destroy_default_group() -> int:
    dist.destroy_process_group()
    return 7


_PROBE_SOURCE = "VERSION = {version}\n\n\ndef version() -> int:\n    return VERSION\n"


def _import_like_pytest(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# Tests


@pytest.mark.filterwarnings("ignore:`torch.distributed.[a-z_]+` is deprecated:FutureWarning")
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_all_gather_and_reduce_scatter_through_gloo(rank_pool: RankPool, world_size: int) -> None:
    """all_gather_into_tensor and reduce_scatter_tensor on the ranks match plain-tensor math."""
    numel = 3
    results = rank_pool.run(_all_gather_and_reduce_scatter, world_size, numel)
    expected_gathered = torch.cat([_shard_of(rank, numel) for rank in range(world_size)])
    summed = sum(_unsharded_of(rank, world_size, numel) for rank in range(world_size))
    assert isinstance(summed, torch.Tensor)
    assert len(results) == world_size
    for rank, (gathered, reduced) in enumerate(results):
        torch.testing.assert_close(gathered, expected_gathered, rtol=0, atol=0)
        expected_reduced = summed[rank * numel : (rank + 1) * numel]
        torch.testing.assert_close(reduced, expected_reduced, rtol=0, atol=0)


def test_run_sets_the_torchrun_environment_and_one_thread(rank_pool: RankPool) -> None:
    """Each rank sees its torchrun variables, 127.0.0.1, one shared port, gloo and one thread."""
    results = rank_pool.run(_environment, 2)
    port = results[0]["master_port"]
    assert isinstance(port, str)
    assert port.isdigit()
    assert results == [
        {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "master_port": port,
            "backend": "gloo",
            "rank": rank,
            "world_size": 2,
            "threads": 1,
        }
        for rank in range(2)
    ]


def test_run_reuses_the_same_workers(rank_pool: RankPool) -> None:
    """Two runs at one world size are served by the same worker processes."""
    first = rank_pool.run(os.getpid, 3)
    second = rank_pool.run(os.getpid, 3)
    assert first == second
    assert len(set(first)) == 3
    assert os.getpid() not in first
    assert 3 in rank_pool.world_sizes


def test_run_returns_tensors_by_value(rank_pool: RankPool) -> None:
    """Tensors of several dtypes, views, parameters and large tensors arrive intact and unshared."""
    results = rank_pool.run(_tensors, 2)
    for rank, result in enumerate(results):
        base = torch.arange(12, dtype=torch.float64).reshape(3, 4) + rank
        torch.testing.assert_close(result["float64"], base, rtol=0, atol=0)
        torch.testing.assert_close(result["view"], base[1:, ::2], rtol=0, atol=0)
        assert result["int64"].tolist() == [rank, -rank]
        assert result["bool"].tolist() == [True, rank % 2 == 1]
        assert isinstance(result["parameter"], torch.nn.Parameter)
        assert result["parameter"].tolist() == [float(rank)] * 2
        assert result["non_leaf"].tolist() == [3.0, 3.0]
        expected_large = torch.arange(1_000_000, dtype=torch.float32) * (rank + 1)
        torch.testing.assert_close(result["large"], expected_large, rtol=0, atol=0)
        assert not any(tensor.is_shared() for tensor in result.values())  # type: ignore[no-untyped-call]


def test_run_sends_functions_of_importable_modules(rank_pool: RankPool) -> None:
    """Functions of importable modules (operator, shard_testing) run on the ranks."""
    assert rank_pool.run(operator.add, 1, 2, 3) == [5]
    local = make_batches(0, 1, 2, 3, _make_one)
    for batches in rank_pool.run(make_batches, 2, 0, 1, 2, 3, _make_one):
        for got, want in zip(batches[0], local[0], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_run_loads_functions_from_their_source_file(rank_pool: RankPool, tmp_path: Path) -> None:
    """A function of a file no process can import by name runs; a changed file is reloaded."""
    name = "shard_testing_pool_probe"
    path = tmp_path / "probe.py"
    try:
        path.write_text(_PROBE_SOURCE.format(version=1))
        assert rank_pool.run(_import_like_pytest(path, name).version, 2) == [1, 1]
        path.write_text(_PROBE_SOURCE.format(version=2))
        stat = path.stat()
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        assert rank_pool.run(_import_like_pytest(path, name).version, 2) == [2, 2]
    finally:
        sys.modules.pop(name, None)


def test_run_sends_instances_of_classes_of_the_test_file(rank_pool: RankPool) -> None:
    """Arguments and results whose class the test file defines travel both ways."""
    assert rank_pool.run(_scaled, 2, _Scale(1.5)) == [_Scale(1.5), _Scale(3.0)]


def test_run_resets_state_between_runs(rank_pool: RankPool, tmp_path: Path) -> None:
    """Default dtype, grad mode, thread count, environment and cwd are restored after a run."""
    [before] = rank_pool.run(_observe_state, 1)
    assert before[:4] == (torch.float32, True, 1, False)
    assert before[4] != str(tmp_path)
    rank_pool.run(_change_state, 1, str(tmp_path))
    assert rank_pool.run(_observe_state, 1) == [before]


def test_run_reports_the_failing_rank_with_its_traceback(rank_pool: RankPool) -> None:
    """An exception on rank 1 only is a RankFailure naming rank 1 with the exception's text."""
    with pytest.raises(
        RankFailure,
        match=(
            r"(?s)^rank 1 of 2 failed running [\w.-]+\._raise_on_rank_one:\n"
            r"----- rank 1 -----\nTraceback \(most recent call last\):\n.*"
            r"ValueError: rank one refuses\n"
            r"The pool of world size 2 was discarded; the next run starts a fresh one\.$"
        ),
    ) as info:
        rank_pool.run(_raise_on_rank_one, 2)
    assert list(info.value.failures) == [1]
    assert info.value.unfinished == ()
    assert 2 not in rank_pool.world_sizes
    assert rank_pool.run(dist.get_rank, 2) == [0, 1]


def test_run_kills_ranks_still_blocked_after_the_grace_period() -> None:
    """Ranks blocked in a collective after another rank failed are killed after the grace period."""
    with RankPool(grace=0.5) as pool:
        start = time.monotonic()
        with pytest.raises(
            RankFailure,
            match=(
                r"(?s)^rank 1 of 2 failed running .*RuntimeError: rank one gives up\n"
                r"rank 0 did not finish within 0\.5 s of the first failure and was killed\.\n"
            ),
        ) as info:
            pool.run(_fail_on_rank_one_while_rank_zero_waits, 2)
        assert info.value.unfinished == (0,)
        assert time.monotonic() - start < 30.0  # the collective timeout is 60 s
        assert pool.world_sizes == ()


def test_run_raises_rank_timeout_naming_the_hung_rank(rank_pool: RankPool) -> None:
    """A rank that outlives the timeout is a RankTimeout naming it; the pool restarts afterwards."""
    with pytest.raises(
        RankTimeout,
        match=(
            r"^rank 1 of 2 did not finish running [\w.-]+\._sleep_on_last_rank within 1 s; "
            r"the pool of world size 2 was killed and the next run starts a fresh one\. If the "
            r"work is legitimately slow, pass a larger timeout= to run\(\) or "
            r"--shard-pool-timeout to pytest\.$"
        ),
    ) as info:
        rank_pool.run(_sleep_on_last_rank, 2, 60.0, timeout=1.0)
    assert info.value.unfinished == (1,)
    assert info.value.timeout == 1.0
    assert rank_pool.run(_sleep_on_last_rank, 2, 0.0) == [0, 1]


def test_run_reports_a_worker_that_exits_with_its_exit_code(rank_pool: RankPool) -> None:
    """A rank calling os._exit(3) is reported with exit code 3 and its last output."""
    with pytest.raises(
        RankFailure,
        match=(
            r"^rank 1 of 2 failed running [\w.-]+\._exit_on_rank_one:\n----- rank 1 -----\n"
            r"died with exit code 3; its output ended with:\nrank one leaves now\n"
        ),
    ):
        rank_pool.run(_exit_on_rank_one, 2, 3)


def test_run_reports_a_worker_killed_by_a_signal(rank_pool: RankPool) -> None:
    """A rank that segfaults is reported with the signal's name and its Python stack."""
    with pytest.raises(
        RankFailure,
        match=r"(?s)\n----- rank 0 -----\nwas killed by SIGSEGV \(exit code -11\); its output "
        r"ended with:\nFatal Python error: Segmentation fault\n.*in _segfault\n",
    ):
        rank_pool.run(_segfault, 1)


def test_run_applies_the_warning_filters_of_the_test(rank_pool: RankPool) -> None:
    """pytest's filterwarnings=error turns a warning on a rank into a RankFailure."""
    with pytest.raises(RankFailure, match=r"UserWarning: a warning from the ranks"):
        rank_pool.run(_warn, 1)


@pytest.mark.filterwarnings("ignore:a warning from the ranks:UserWarning")
def test_run_applies_filterwarnings_marks(rank_pool: RankPool) -> None:
    """A filterwarnings mark on the test silences the warning on the ranks too."""
    assert rank_pool.run(_warn, 1) == [0]


def test_run_reports_a_result_that_cannot_be_pickled(rank_pool: RankPool) -> None:
    """A return value pickle refuses is a RankFailure saying so."""
    with pytest.raises(
        RankFailure,
        match=r"the value returned by _unpicklable_result \(a lock\) could not be pickled",
    ):
        rank_pool.run(_unpicklable_result, 1)


def test_run_restarts_a_group_whose_default_process_group_was_destroyed(
    rank_pool: RankPool,
) -> None:
    """A function that destroys the default group gets its result; the next run gets fresh ranks."""
    assert rank_pool.run(_destroy_default_group, 1) == [7]
    assert 1 not in rank_pool.world_sizes
    assert rank_pool.run(dist.get_world_size, 1) == [1]


def test_run_rejects_functions_that_cannot_travel(rank_pool: RankPool) -> None:
    """Lambdas and nested functions are refused before any rank starts."""
    with pytest.raises(TypeError, match=r"<lambda> cannot be sent to the ranks: define rank"):
        rank_pool.run(lambda: 1, 1)


def test_run_rejects_arguments_that_cannot_be_pickled(rank_pool: RankPool) -> None:
    """An argument pickle refuses is a TypeError naming the function."""
    with pytest.raises(
        TypeError,
        match=r"^cannot send _operator\.add and its arguments to the ranks: cannot pickle "
        r"'_thread\.lock' object; define the function",
    ):
        rank_pool.run(operator.add, 1, threading.Lock(), 1)


@pytest.mark.parametrize("world_size", [0, -1, True, 2.0])
def test_run_rejects_bad_world_sizes(rank_pool: RankPool, world_size: object) -> None:
    """World sizes that are not positive ints are refused with the value seen."""
    with pytest.raises(ValueError, match=rf"^world_size must be a positive int, got {world_size}$"):
        rank_pool.run(os.getpid, world_size)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("timeout", 0, r"^timeout must be > 0 seconds, got 0$"),
        ("grace", -1.0, r"^grace must be >= 0 seconds, got -1\.0$"),
        ("collective_timeout", float("nan"), r"^collective_timeout must be > 0 seconds, got nan$"),
    ],
)
def test_rank_pool_rejects_bad_seconds(option: str, value: float, message: str) -> None:
    """Non-positive or NaN durations are refused with the option's name and value."""
    with pytest.raises(ValueError, match=message):
        RankPool(**{option: value})


def test_run_raises_rank_timeout_when_the_ranks_do_not_start_in_time() -> None:
    """A group that cannot start within start_timeout is killed and reported as a RankTimeout."""
    pool = RankPool(start_timeout=0.01)
    with pytest.raises(
        RankTimeout,
        match=r"^rank 0 of 1 did not finish starting within 0\.01 s; the pool of world size 1 "
        r"was killed and the next run starts a fresh one\. If the work is legitimately slow, "
        r"pass a larger start_timeout= to RankPool\.$",
    ):
        pool.run(os.getpid, 1)
    assert pool.world_sizes == ()


def test_close_stops_every_worker() -> None:
    """Leaving the with-block stops the workers; the pool starts fresh ones when used again."""
    with RankPool() as pool:
        pids = pool.run(os.getpid, 1)
        assert _is_alive(pids[0])
    assert pool.world_sizes == ()
    assert not _is_alive(pids[0])
