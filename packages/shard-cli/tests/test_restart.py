"""``--max-restarts``: what the launcher passes on, and what a restarted rank resumes from.

The restart end to end (a rank killed, the run continuing exactly) is in
``test_restart_end_to_end.py``; these tests cover the decisions in one
process, with checkpoints written by hand.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from torch._C._distributed_c10d import TCPStore

from shard_checkpoint import save
from shard_cli import TrainOptions
from shard_cli._launch import launch
from shard_cli._train import _check_restart_store, _Run, restart_options
from shard_cli._train_checkpoint import LAUNCH_ENV, launch_id, read_info
from shard_comms.plumbing import SHARD_STORE_ENV


def _options(tmp_path: Path, **changes: Any) -> TrainOptions:
    return TrainOptions(preset="tiny", steps=8, run_dir=str(tmp_path / "run"), **changes)


def _checkpoint(options: TrainOptions, step: int, launch: str | None) -> None:
    train: dict[str, Any] = {"step": step, "world_size": 2, "frontend": "fully_shard"}
    if launch is not None:
        train["launch"] = launch
    save({"train": train}, checkpoint_id=options.checkpoint_path)


@pytest.fixture
def this_launch(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(LAUNCH_ENV, "launch-a")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    return "launch-a"


def test_launch_id_prefers_the_launcher_and_ignores_torchruns_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """shard train's id first; else the rendezvous id, but never torchrun's shared 'none'."""
    monkeypatch.setenv(LAUNCH_ENV, "mine")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rdzv")
    assert launch_id() == "mine"
    monkeypatch.delenv(LAUNCH_ENV)
    assert launch_id() == "rdzv"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert launch_id() == ""


def test_a_restart_resumes_from_this_launchs_checkpoint(tmp_path: Path, this_launch: str) -> None:
    options = _options(tmp_path)
    _checkpoint(options, 3, this_launch)
    assert read_info(options.checkpoint_path) is not None
    resumed, note, finished = restart_options(options, 1)
    assert resumed == TrainOptions(**{**options.to_json(), "resume": True})
    assert not finished
    assert note == (
        "shard train: restart 1 after a rank failed: resuming from the checkpoint at step 3 "
        f"({options.checkpoint_path})"
    )


@pytest.mark.parametrize("launch", ["launch-b", "", None], ids=["other", "no id", "old format"])
def test_a_restart_never_takes_another_launchs_checkpoint(
    tmp_path: Path, this_launch: str, launch: str | None
) -> None:
    """A checkpoint an earlier run left (or one with no launch recorded): start over."""
    options = _options(tmp_path)
    _checkpoint(options, 3, launch)
    again, note, finished = restart_options(options, 2)
    assert (again, finished) == (options, False)
    assert note == (
        "shard train: restart 2 after a rank failed: no checkpoint of this run yet at "
        f"{options.checkpoint_path}, starting over from step 1"
    )


def test_a_resumed_launch_restarts_from_the_checkpoint_it_resumed(
    tmp_path: Path, this_launch: str
) -> None:
    """--resume --max-restarts: the checkpoint the launch began from is this run's."""
    options = _options(tmp_path, resume=True)
    _checkpoint(options, 6, "launch-b")
    again, _, finished = restart_options(options, 1)
    assert (again, finished) == (options, False)


@pytest.mark.parametrize("resume", [True, "latest-intact"])
def test_a_restart_keeps_the_users_resume_mode(
    tmp_path: Path, this_launch: str, resume: bool | str
) -> None:
    """--resume latest-intact --max-restarts: the restart falls back past a corrupt
    checkpoint too; a plain --resume (or none) restarts refusing one."""
    options = _options(tmp_path, resume=resume)
    _checkpoint(options, 3, this_launch)
    again, _, _ = restart_options(options, 1)
    assert again.resume == resume


def test_a_restart_after_the_last_step_has_nothing_to_redo(
    tmp_path: Path, this_launch: str
) -> None:
    options = _options(tmp_path)
    _checkpoint(options, 8, this_launch)
    _, note, finished = restart_options(options, 1)
    assert finished
    assert "is at the last step (8); training is complete, nothing to redo" in note


@pytest.mark.parametrize("data", [None, "corpus.txt"])
def test_a_restart_on_changed_data_is_refused_naming_it(tmp_path: Path, data: str | None) -> None:
    """The run's data with other contents since it started: an error, not other batches.

    (A restart after such an edit once trained on other batches from its
    first step on; see [Note: batches from the step alone] in _corpus.py.)
    """
    run = SimpleNamespace(
        options=_options(tmp_path, data=data), run_dir=tmp_path / "run", data_fingerprint="b" * 16
    )
    check = _Run._check_same_data
    check(run, {"path": data, "fingerprint": "b" * 16})  # type: ignore[arg-type]
    check(run, {"path": "other.txt", "fingerprint": "a" * 16})  # type: ignore[arg-type]
    check(run, None)  # type: ignore[arg-type]  # a run directory from before fingerprints
    with pytest.raises(RuntimeError) as error:
        check(run, {"path": data, "fingerprint": "a" * 16})  # type: ignore[arg-type]
    what = (
        f"--data {data}"
        if data
        else "shard's sources (the installed shard packages were edited or upgraded)"
    )
    assert str(error.value) == (
        f"--resume: the training data changed since {tmp_path / 'run'} was started: {what} "
        f"holds other text now (fingerprint {'b' * 16}, the run started with {'a' * 16}), so "
        "the steps to come would draw other batches than an uninterrupted run; put the data "
        "back as it was, or start a new run with another --run-dir"
    )


def test_a_restart_through_the_agents_shared_store_is_refused_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(RuntimeError, match=r"set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        _check_restart_store()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    _check_restart_store()


def test_a_restart_through_the_launchers_store_is_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """shard train's ranks rendezvous through the launcher's store, one prefix per attempt."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv(SHARD_STORE_ENV, "127.0.0.1:29400")
    _check_restart_store()


@pytest.fixture
def fake_torchrun(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], dict[str, str]]]:
    """Replace the elastic launcher; record its arguments and environment."""
    import torch.distributed.run

    calls: list[tuple[list[str], dict[str, str]]] = []
    agent_store = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    for name in (SHARD_STORE_ENV, LAUNCH_ENV, agent_store, "OMP_NUM_THREADS", "KINETO_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)

    def main(args: list[str]) -> None:
        env = dict(os.environ)
        # What a rank does with the store: write a key, read it back.
        host, port = env[SHARD_STORE_ENV].split(":")
        store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
        store.set("probe", "from a rank")
        env["probe"] = store.get("probe").decode()
        calls.append((args, env))

    monkeypatch.setattr(torch.distributed.run, "main", main)
    return calls


@pytest.mark.parametrize("restarts", [0, 2])
def test_the_launcher_passes_max_restarts_one_launch_id_and_its_store(
    fake_torchrun: list[tuple[list[str], dict[str, str]]], tmp_path: Path, restarts: int
) -> None:
    """--max-restarts reaches the agent; the ranks get one launch id and the launcher's store."""
    assert launch(_options(tmp_path, max_restarts=restarts), ["--steps", "8"]) == 0
    [(args, env)] = fake_torchrun
    assert f"--max-restarts={restarts}" in args
    assert args[-3:] == ["train", "--steps", "8"]
    assert len(env[LAUNCH_ENV]) == 32
    assert env[SHARD_STORE_ENV].startswith("127.0.0.1:")
    assert env["probe"] == "from a rank"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in env
    assert LAUNCH_ENV not in os.environ
    assert SHARD_STORE_ENV not in os.environ


def test_restarts_used_up_are_named_in_the_stop_message(
    monkeypatch: pytest.MonkeyPatch,
    fake_torchrun: list[tuple[list[str], dict[str, str]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def fail(args: list[str]) -> None:
        failure = ProcessFailure(local_rank=1, pid=1, exitcode=-9, error_file="")
        raise ChildFailedError("shard_cli", {1: failure})

    monkeypatch.setattr(torch.distributed.run, "main", fail)
    assert launch(_options(tmp_path, max_restarts=1), []) == 1
    assert (
        "shard train: stopped: rank 1 was killed by SIGKILL, after 1 restart (--max-restarts); "
        "every rank was stopped." in capsys.readouterr().err
    )
