"""async_save: the values at the call, one save at a time, and a crash that costs nothing saved.

Two ranks of the pool save both front ends' model and optimizer state while
training goes on (collectives on the default group in between), and the
checkpoint loads to exactly what a blocking save of the same moment gives,
and to what PyTorch's own ``dcp.async_save`` writes. Ordering and failures
are shown in one process with a writer that waits or fails; the crash is a
real process killed while its background thread writes.
"""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.device_mesh import init_device_mesh
from torch.futures import Future

import shard_checkpoint._integrity as integrity
from shard_checkpoint import (
    CheckpointError,
    StateDictOptions,
    async_save,
    close_async_saves,
    get_model_state_dict,
    get_optimizer_state_dict,
    load,
    save,
    verify_checkpoint,
)
from shard_checkpoint._storage import quiet_single_process
from shard_runtime import FullyShardedDataParallel, ModuleWrapPolicy, fully_shard
from shard_testing import RankPool
from shard_testing.models import ResidualBlock, ToyNet, toy_batches
from shard_testing.resume import assert_bitwise_equal

FULL = StateDictOptions(full_state_dict=True)


def _build(front: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model: nn.Module = ToyNet(blocks=2, seed=seed)
    if front == "fully_shard":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({ResidualBlock}))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    x, y = toy_batches(dist.get_world_size(), steps=step + 1)[step][0][dist.get_rank()]
    nn.functional.mse_loss(model(x), y).backward()
    optim.step()
    optim.zero_grad()


def _state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}


def _full(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Full values, copied (a full state dict may share tensors, Adam's steps, with the live)."""
    return copy.deepcopy(
        {
            "model": get_model_state_dict(model, options=FULL),
            "optim": get_optimizer_state_dict(model, optim, options=FULL),
        }
    )


def _loaded(front: str, path: str) -> dict[str, Any]:
    model, optim = _build(front, seed=1)
    _train_step(model, optim, 0)  # optimizer state to load into
    state = _state(model, optim)
    load(state, checkpoint_id=path)
    from shard_checkpoint import set_state_dict

    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _full(model, optim)


def _async_while_training(front: str, root: str) -> dict[str, Any]:
    """Save step 1 in the background while steps 2-3 train; blocking and DCP saves beside it."""
    model, optim = _build(front, seed=0)
    _train_step(model, optim, 0)
    at_call = _full(model, optim)
    handle = async_save(_state(model, optim), checkpoint_id=f"{root}/async")
    for step in (1, 2):  # training goes on, collectives on the default group included
        _train_step(model, optim, step)
    handle.result()
    close_async_saves()
    assert not torch.equal(  # training did change what was saved
        _full(model, optim)["model"]["embed.weight"], at_call["model"]["embed.weight"]
    )
    if front == "fully_shard":  # PyTorch's own async save of the same moment, beside ours
        reference, reference_optim = _build(front, seed=0)
        _train_step(reference, reference_optim, 0)
        dcp.async_save(_state(reference, reference_optim), checkpoint_id=f"{root}/dcp").result()  # type: ignore[union-attr]
    model, optim = _build(front, seed=0)
    _train_step(model, optim, 0)
    save(_state(model, optim), checkpoint_id=f"{root}/blocking")
    return {
        "at_call": at_call,
        "async": _loaded(front, f"{root}/async"),
        "blocking": _loaded(front, f"{root}/blocking"),
        "dcp": _loaded(front, f"{root}/dcp") if front == "fully_shard" else None,
        "blocked_s": handle.blocked_s,
    }


@pytest.mark.parametrize("front", ["fully_shard", "wrapper"])
def test_async_save_holds_the_values_at_the_call(
    rank_pool: RankPool, tmp_path: Path, front: str
) -> None:
    """2 ranks: model and Adam state load back as they were at the call, bit for bit, as a
    blocking save of that moment (and PyTorch's dcp.async_save) give them."""
    for result in rank_pool.run(_async_while_training, 2, front, str(tmp_path)):
        assert_bitwise_equal(result["async"], result["at_call"], "async")
        assert_bitwise_equal(result["blocking"], result["at_call"], "blocking")
        if result["dcp"] is not None:
            assert_bitwise_equal(result["async"], result["dcp"], "dcp")
    assert sorted(os.listdir(tmp_path / "async")) == sorted(os.listdir(tmp_path / "blocking"))
    assert sorted(os.listdir(tmp_path / "async")) == [
        ".checksums",
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert verify_checkpoint(tmp_path / "async").files == 3
    # The staged copy keeps every tensor's dtype, shape, requires_grad and sharding: the
    # checkpoint's metadata is the blocking save's.
    assert (
        FileSystemReader(str(tmp_path / "async")).read_metadata().state_dict_metadata
        == FileSystemReader(str(tmp_path / "blocking")).read_metadata().state_dict_metadata
    )


@pytest.fixture(autouse=True)
def _closed() -> Iterator[None]:
    """Each test's background saves end with it: the copy and the thread's work are freed."""
    yield
    close_async_saves()


class _GatedWriter:
    """Makes ``ChecksummingWriter.write_data`` log its start and end, and wait on a gate."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> None:
        self.log: list[str] = []
        self.gate = threading.Event()
        real = integrity.ChecksummingWriter.write_data
        gated = self

        def write_data(
            writer: integrity.ChecksummingWriter, plan: SavePlan, planner: SavePlanner
        ) -> Future[list[WriteResult]]:
            name = Path(writer.path).name.split(".incomplete-")[0]
            gated.log.append(f"start {name}")
            gated.gate.wait(timeout=30)
            if fail:
                raise OSError("disk full (simulated)")
            result = real(writer, plan, planner)
            gated.log.append(f"end {name}")
            return result

        monkeypatch.setattr(integrity.ChecksummingWriter, "write_data", write_data)


def test_a_new_save_waits_for_the_one_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second save (async or blocking) starts writing only after the first is in place."""
    gated = _GatedWriter(monkeypatch)
    first = async_save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "one")
    done: list[str] = []
    second = threading.Thread(
        target=lambda: done.append(str(save({"w": torch.zeros(3)}, checkpoint_id=tmp_path / "two")))
    )
    second.start()
    second.join(timeout=0.5)
    assert gated.log == ["start one"]
    assert not first.done()
    assert not done
    gated.gate.set()
    second.join(timeout=30)
    assert gated.log == ["start one", "end one", "start two", "end two"]
    assert first.done()
    assert len(done) == 1
    state = {"w": torch.empty(3)}
    load(state, checkpoint_id=tmp_path / "one")
    assert torch.equal(state["w"], torch.ones(3))


def test_a_failed_async_save_is_raised_once_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """result() raises the save's error; the next save does not raise it again."""
    path = tmp_path / "ckpt"
    save({"w": torch.ones(3)}, checkpoint_id=path)
    gated = _GatedWriter(monkeypatch, fail=True)
    gated.gate.set()
    handle = async_save({"w": torch.zeros(3)}, checkpoint_id=path)
    with pytest.raises(CheckpointError, match=r"^saving checkpoint .* failed on rank 0: OSError: "):
        handle.result()
    monkeypatch.undo()
    state = {"w": torch.empty(3)}
    load(state, checkpoint_id=path)
    assert torch.equal(state["w"], torch.ones(3))
    async_save({"w": torch.full((3,), 2.0)}, checkpoint_id=path).result()
    load(state, checkpoint_id=path)
    assert torch.equal(state["w"], torch.full((3,), 2.0))


def test_an_unread_failure_is_raised_by_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed save nobody waited for fails the next save (which does not start)."""
    gated = _GatedWriter(monkeypatch, fail=True)
    gated.gate.set()
    async_save({"w": torch.zeros(3)}, checkpoint_id=tmp_path / "first")
    with pytest.raises(CheckpointError, match=r"^saving checkpoint .*first failed on rank 0"):
        async_save({"w": torch.zeros(3)}, checkpoint_id=tmp_path / "second")
    assert not (tmp_path / "second").exists()
    assert gated.log == ["start first"]


def test_then_runs_once_the_checkpoint_is_in_place(tmp_path: Path) -> None:
    """The callback sees the complete checkpoint at its final path."""
    seen: list[tuple[Path, bool]] = []
    handle = async_save(
        {"w": torch.ones(2)},
        checkpoint_id=tmp_path / "ckpt",
        verify=True,
        then=lambda path: seen.append((path, verify_checkpoint(path).checksummed)),
    )
    handle.result()
    assert seen == [(tmp_path / "ckpt", True)]


def test_a_state_dict_with_other_leaves_is_copied_by_dcps_stager(tmp_path: Path) -> None:
    """A leaf StagingBuffers leaves alone (a BytesIO) sends the whole copy to DefaultStager:
    the values at the call are saved all the same."""
    weight = torch.ones(3)
    handle = async_save(
        {"w": weight, "blob": io.BytesIO(b"at the call")}, checkpoint_id=tmp_path / "ckpt"
    )
    weight.add_(1)
    handle.result()
    state = {"w": torch.empty(3), "blob": io.BytesIO()}
    load(state, checkpoint_id=tmp_path / "ckpt")
    assert torch.equal(state["w"], torch.ones(3))
    assert state["blob"].getvalue() == b"at the call"


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's SCHED_IDLE")
def test_the_writer_runs_at_idle_priority_until_something_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a save is written the writer thread is SCHED_IDLE and the GIL switch interval
    short; result() gives the writer the normal priority; the interval is restored after."""
    before = sys.getswitchinterval()
    gated = _GatedWriter(monkeypatch)
    handle = async_save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "a")
    _wait_for(lambda: gated.log == ["start a"])
    [writer] = _writer_threads()
    assert writer.native_id is not None
    assert os.sched_getscheduler(writer.native_id) == os.SCHED_IDLE
    assert sys.getswitchinterval() == pytest.approx(0.0002)
    waiter = threading.Thread(target=handle.result)
    waiter.start()
    if _may_leave_idle_priority():
        _wait_for(lambda: os.sched_getscheduler(writer.native_id or 0) == os.SCHED_OTHER)
    else:  # unprivileged under RLIMIT_NICE 0: the writer stays idle and the save still ends
        waiter.join(timeout=0.2)
        assert os.sched_getscheduler(writer.native_id) == os.SCHED_IDLE
    gated.gate.set()
    waiter.join(timeout=30)
    assert handle.done()
    assert sys.getswitchinterval() == before
    # The next save goes back to idle priority.
    gated.gate.clear()
    second = async_save({"w": torch.zeros(2)}, checkpoint_id=tmp_path / "b")
    _wait_for(lambda: gated.log[-1] == "start b")
    assert os.sched_getscheduler(writer.native_id) == os.SCHED_IDLE
    gated.gate.set()
    second.result()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's SCHED_IDLE")
def test_a_save_waited_for_before_it_starts_is_written_at_normal_priority(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """result() called at once (before the writer thread picks the save up) is not undone by
    the writer then lowering its own priority."""
    if not _may_leave_idle_priority():
        pytest.skip("this process may not leave SCHED_IDLE (RLIMIT_NICE)")
    gated = _GatedWriter(monkeypatch)
    gated.gate.set()
    async_save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "a").result()  # the thread exists
    for name in ("b", "c", "d"):
        gated.gate.clear()
        handle = async_save({"w": torch.zeros(2)}, checkpoint_id=tmp_path / name)
        waiter = threading.Thread(target=handle.result)
        waiter.start()
        _wait_for(lambda n=name: gated.log[-1] == f"start {n}")
        [writer] = _writer_threads()
        assert os.sched_getscheduler(writer.native_id or 0) == os.SCHED_OTHER, name
        gated.gate.set()
        waiter.join(timeout=30)
        assert handle.done()


def _may_leave_idle_priority() -> bool:
    """Whether a thread of this process may go from SCHED_IDLE back to SCHED_OTHER."""
    allowed: list[bool] = []

    def probe() -> None:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            allowed.append(True)
        except PermissionError:
            allowed.append(False)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return allowed == [True]


def _writer_threads() -> list[threading.Thread]:
    """The background saves' writer threads alive now."""
    return [t for t in threading.enumerate() if t.name.startswith("shard-ckpt")]


def _wait_for(condition: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_close_ends_the_writer_thread_and_a_later_save_starts_one(tmp_path: Path) -> None:
    """Nothing of the background saves outlives close_async_saves; the next save works."""

    async_save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "a").result()
    assert len(_writer_threads()) == 1
    close_async_saves()
    assert _writer_threads() == []
    async_save({"w": torch.zeros(2)}, checkpoint_id=tmp_path / "b").result()
    assert len(_writer_threads()) == 1
    assert torch.equal(_loaded_plain(tmp_path / "b"), torch.zeros(2))


def _loaded_plain(path: Path) -> torch.Tensor:
    state = {"w": torch.empty(2)}
    load(state, checkpoint_id=path)
    return state["w"]


_CRASH = """
import os, sys, threading, torch
import shard_checkpoint._integrity as integrity
from shard_checkpoint import async_save, save
root = sys.argv[1]
save({"w": torch.ones(1000)}, checkpoint_id=root + "/step-1")
real = integrity.ChecksummingWriter.write_data
def write_then_die(writer, plan, planner):
    real(writer, plan, planner)  # this rank's data file is written: die before it is in place
    os.kill(os.getpid(), 9)
integrity.ChecksummingWriter.write_data = write_then_die
async_save({"w": torch.zeros(1000)}, checkpoint_id=root + "/step-2").result()
"""


def test_a_crash_during_an_async_save_leaves_the_previous_checkpoint_loadable(
    tmp_path: Path,
) -> None:
    """A process SIGKILLed while its background thread writes step 2: step 1 loads, verified."""
    crashed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CRASH), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert crashed.returncode == -9, crashed.stderr
    [leftover] = [p.name for p in tmp_path.iterdir() if p.name != "step-1"]
    assert leftover.startswith("step-2.incomplete-")
    assert (tmp_path / leftover / "__0_0.distcp").is_file()
    assert not (tmp_path / leftover / ".metadata").exists()
    state = {"w": torch.empty(1000)}
    with quiet_single_process():
        load(state, checkpoint_id=tmp_path)  # the newest complete step
    assert torch.equal(state["w"], torch.ones(1000))
    assert verify_checkpoint(tmp_path).path == tmp_path / "step-1"
