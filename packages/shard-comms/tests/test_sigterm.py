"""A rank its launcher stops with SIGTERM says what it knows, then ends, within the grace.

Each scenario runs two gloo ranks as plain subprocesses (this file, run as a
script) that join through ``init_distributed`` and a TCPStore this test
hosts (``SHARD_STORE_ENDPOINT``, as ``shard train``'s launcher does), run
three all-reduces in step 7, then wait. The test then stops them as a
launcher would:

- ``clean``: SIGTERM to both (the whole job is stopped): both end at once,
  well within the grace, and say nothing;
- ``blocked``: rank 0 blocked inside an all-reduce that the live rank 1
  never joins, then SIGTERM to rank 0: the handler cannot run on the main
  thread, so the watcher thread reports and ends the process (exit status
  143) at the grace plus its one-second margin.

Both scenarios start at once, so the module costs one start-up of its
ranks. A survivor of a dead rank, stopped before any collective failed, is
tested under the real torchrun (``integration_tests/test_torchrun_faults.py``).
``SHARD_SIGTERM_GRACE_S`` parsing and when the handler is not installed are
tested in this process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest

from shard_comms import _terminate
from shard_core.errors import CommError

GRACE_S = 2.0
SCENARIOS = ("clean", "blocked")
BOUND_S = 120.0  # start-up of every rank on a shared 2-core machine


# ----------------------------------------------------------------------------- rank side


def _rank_main(scenario: str, rank: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        SHARD_STORE_ENDPOINT=f"127.0.0.1:{port}",
        SHARD_SIGTERM_GRACE_S=str(GRACE_S),
    )
    import torch

    import shard_comms as sc

    torch.set_num_threads(1)
    sc.init_distributed(timeout=120)
    sc.set_training_step(7)
    tensor = torch.ones(4)
    for _ in range(3):
        sc.all_reduce(tensor, label="loss", phase="end of step")
    if scenario == "blocked" and rank == 0:
        main = threading.main_thread().ident
        assert main is not None

        def ready_once_blocked() -> None:
            # The main thread's innermost frame is torch's all_reduce: it waits inside gloo.
            while sys._current_frames()[main].f_code.co_name != "all_reduce":
                time.sleep(0.01)
            time.sleep(0.2)
            print("ready", flush=True)

        threading.Thread(target=ready_once_blocked, daemon=True).start()
        sc.all_reduce(tensor, label="stuck", phase="end of step")
    print("ready", flush=True)
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))


# ----------------------------------------------------------------------------- test side


def _readline(proc: subprocess.Popen[str], deadline: float) -> str:
    """The next line of ``proc``'s stdout, or "" when it ends or the deadline passes."""
    assert proc.stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(max(0.0, deadline - time.monotonic()))
    return lines[0] if lines else ""


def _wait(proc: subprocess.Popen[str], deadline: float) -> int | None:
    try:
        return proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Start every scenario, stop it as a launcher would; how each rank ended and what it said."""
    from torch._C._distributed_c10d import TCPStore

    root = tmp_path_factory.mktemp("sigterm")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARD_FLIGHT_RECORDER_DUMP": ""}
    stores = []
    logs: list[IO[str]] = []
    procs: dict[str, list[subprocess.Popen[str]]] = {}
    for scenario in SCENARIOS:
        store = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
        stores.append(store)
        procs[scenario] = []
        for rank in range(2):
            logs.append((root / f"{scenario}.{rank}.err").open("w"))
            procs[scenario].append(
                subprocess.Popen(
                    [sys.executable, __file__, scenario, str(rank), str(store.port)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=logs[-1],
                    text=True,
                )
            )
    deadline = time.monotonic() + BOUND_S
    results: dict[str, dict[str, Any]] = {}
    try:
        for scenario, (first, second) in procs.items():
            ready = [_readline(first, deadline), _readline(second, deadline)]
            why = (scenario, ready, [first.poll(), second.poll()], _stderr(root, scenario))
            assert ready == ["ready\n", "ready\n"], why
        sent = time.monotonic()
        for proc in procs["clean"]:
            proc.send_signal(signal.SIGTERM)
        procs["blocked"][0].send_signal(signal.SIGTERM)
        sent_in = time.monotonic() - sent
        # The ranks that were stopped, and when each ended (rank 1 of "blocked" never is).
        stopped = [*procs["clean"], procs["blocked"][0]]
        ended: dict[int, float] = {}
        while len(ended) < len(stopped) and time.monotonic() < sent + GRACE_S + 30.0:
            for proc in stopped:
                if proc.pid not in ended and proc.poll() is not None:
                    ended[proc.pid] = time.monotonic() - sent
            time.sleep(0.02)
        for scenario, ranks in procs.items():
            results[scenario] = {
                "codes": [proc.poll() for proc in ranks],
                "seconds": [ended.get(proc.pid) for proc in ranks],
                "sent_in": sent_in,
            }
    finally:
        for ranks in procs.values():
            for proc in ranks:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                assert proc.stdout is not None
                proc.stdout.close()
        for log in logs:
            log.close()
    for scenario in SCENARIOS:
        results[scenario]["stderr"] = [_stderr(root, scenario, rank) for rank in range(2)]
    return results


def _stderr(root: Path, scenario: str, rank: int | None = None) -> str:
    ranks = [rank] if rank is not None else [0, 1]
    return "".join((root / f"{scenario}.{r}.err").read_text(errors="replace") for r in ranks)


def test_a_whole_job_stopped_ends_at_once_and_says_nothing(
    outcomes: dict[str, dict[str, Any]],
) -> None:
    """SIGTERM to every rank: each finds the other's record at once, ends by SIGTERM, silent."""
    clean = outcomes["clean"]
    assert clean["codes"] == [-signal.SIGTERM, -signal.SIGTERM], clean
    assert clean["stderr"] == ["", ""]


def test_a_rank_blocked_in_a_collective_still_reports_and_ends_within_the_bound(
    outcomes: dict[str, dict[str, Any]],
) -> None:
    """Rank 0 stuck in gloo (rank 1 alive, never joining): the watcher reports, exits 143."""
    blocked = outcomes["blocked"]
    assert blocked["codes"][0] == 128 + signal.SIGTERM, blocked
    lines = blocked["stderr"][0].splitlines()
    assert lines[0] == (
        "shard: rank 0 of 2 was stopped by SIGTERM (its launcher ending the job) during step 7; "
        "its last collective: all-reduce of `stuck` (end of step, step 7, seq 3) [issued]"
    ), lines
    assert lines[3] == (
        "  rank 1 was last seen in the all-reduce of `loss` (end of step, step 7, seq 2), the "
        "last collective it completed with this rank; it did not complete the all-reduce of "
        "`stuck` (end of step, step 7, seq 3)"
    ), lines


def test_every_stopped_rank_ended_within_the_grace_and_its_margin(
    outcomes: dict[str, dict[str, Any]],
) -> None:
    """No scenario kept a rank alive past the grace plus the watcher's margin (and slack)."""
    slack = 3.0  # a loaded 2-core machine: process exit and this test's own polling
    seconds = {scenario: outcomes[scenario]["seconds"] for scenario in SCENARIOS}
    bound = GRACE_S + _terminate._EXIT_MARGIN_S + outcomes["clean"]["sent_in"] + slack
    for took in [*seconds["clean"], seconds["blocked"][0]]:
        assert took is not None, seconds
        assert took < bound, seconds
    # The blocked rank waited the grace for rank 1's record; the clean stop did not wait.
    assert seconds["blocked"][0] >= GRACE_S, seconds
    assert max(seconds["clean"]) < GRACE_S, seconds


# ----------------------------------------------------------------------------- in this process


@pytest.mark.parametrize(("raw", "seconds"), [("", 3.0), ("0", 0.0), (" 1.5 ", 1.5)])
def test_the_grace_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, raw: str, seconds: float
) -> None:
    monkeypatch.setenv("SHARD_SIGTERM_GRACE_S", raw)
    assert _terminate.grace_seconds() == seconds


@pytest.mark.parametrize("raw", ["soon", "-1", "nan"])
def test_a_grace_that_is_not_seconds_is_named(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("SHARD_SIGTERM_GRACE_S", raw)
    with pytest.raises(CommError) as error:
        _terminate.grace_seconds()
    assert str(error.value) == (
        f"SHARD_SIGTERM_GRACE_S={raw!r} is not a number of seconds; set it to e.g. 3 (how long "
        "a rank stopped by SIGTERM may spend reporting), or 0 to end at once"
    )


def test_nothing_is_installed_with_no_grace_off_the_main_thread_or_over_a_handler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Grace 0, another thread, or the program's own SIGTERM handler: SIGTERM is left alone."""
    monkeypatch.setattr(_terminate, "_STATE", None)
    assert _terminate.install(lambda deadline: None, grace=0.0) is False
    found: list[bool] = []
    thread = threading.Thread(
        target=lambda: found.append(_terminate.install(lambda deadline: None, grace=1.0))
    )
    thread.start()
    thread.join()
    assert found == [False]
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        assert _terminate.install(lambda deadline: None, grace=1.0) is False
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert not _terminate.installed()
