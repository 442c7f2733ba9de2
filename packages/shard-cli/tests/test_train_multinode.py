"""README's several-machines ``torchrun`` command, run as two "machines" on this host.

The command is read from the "Several machines" section of the repository's
README.md, so the test follows the README. Each machine is one ``torchrun`` started from its own
working directory with the README's arguments, except for three changes that
make it fit on one small host: ``HOST`` becomes 127.0.0.1 with a free port,
one rank per machine, and a tiny model for three steps (flags appended after
the README's, where argparse lets the last one win). The run directory is
absolute: the one directory both machines see, as the README asks.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from shard_cli import inspect_checkpoint
from shard_cli._train_checkpoint import read_step

ROOT = Path(__file__).resolve().parents[3]  # the repository, whose README this test follows
README = (ROOT / "README.md").read_text(encoding="utf-8")

STEPS = 3
SHORT = ["--preset", "tiny", "--steps", str(STEPS), "--batch", "4", "--seq", "32"]
# A rank left behind by a failed run stops after this long instead of the default 300 s.
QUICK = ["--sample-chars", "0", "--timeout", "30"]
DEADLINE_S = 120.0


def readme_multinode_command() -> list[str]:
    """The ``torchrun`` command of README's "Several machines" section, as argv."""
    section = README.split("## Several machines", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash[^\n]*\n(.*?)```", section, re.DOTALL)
    assert block is not None, "README's 'Several machines' section has no bash block"
    return shlex.split(block.group(1).replace("\\\n", " "))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _option(argv: list[str], flag: str) -> int:
    assert flag in argv, f"README's torchrun command has no {flag}: {shlex.join(argv)}"
    return argv.index(flag) + 1


def machine_command(readme: list[str], port: int, run_dir: Path) -> list[str]:
    """What one machine runs: README's arguments, fitted to this host, then a short run."""
    assert readme[0] == "torchrun", f"README's command does not start with torchrun: {readme}"
    args = readme[1:]
    at = _option(args, "--rdzv-endpoint")
    host, _, readme_port = args[at].partition(":")
    assert (host, readme_port) == ("HOST", "29500"), args[at]
    args[at] = f"127.0.0.1:{port}"
    args[_option(args, "--nproc-per-node")] = "1"
    tail = [*SHORT, *QUICK, "--run-dir", str(run_dir)]
    return [sys.executable, "-m", "torch.distributed.run", *args, *tail]


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each agent (it terminates its ranks), then SIGKILL any left."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_readme_torchrun_command_trains_one_run_across_two_machines(tmp_path: Path) -> None:
    """Two concurrent torchruns of README's command form one world of 2 and finish a run."""
    readme = readme_multinode_command()
    nodes = int(readme[_option(readme, "--nnodes")])
    assert nodes == 2
    run_dir = tmp_path / "shared" / "run"
    command = machine_command(readme, _free_port(), run_dir)
    # CPU ranks everywhere: on a one-GPU host both machines' LOCAL_RANK 0 would share it.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    procs: list[subprocess.Popen[bytes]] = []
    outputs: list[tuple[Path, Path]] = []
    try:
        for node in range(nodes):
            where = tmp_path / f"machine{node}"
            where.mkdir()
            out, err = where / "stdout", where / "stderr"
            outputs.append((out, err))
            with out.open("wb") as stdout, err.open("wb") as stderr:
                procs.append(
                    subprocess.Popen(command, cwd=where, env=env, stdout=stdout, stderr=stderr)
                )
        deadline = time.monotonic() + DEADLINE_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        late = [n for n, p in enumerate(procs) if p.poll() is None]
    finally:
        _stop(procs)
    texts = [(o.read_text("utf-8"), e.read_text("utf-8")) for o, e in outputs]
    report = "\n".join(f"machine {n}:\n{o[-2000:]}\n{e[-3000:]}" for n, (o, e) in enumerate(texts))
    assert late == [], f"machines {late} still ran after {DEADLINE_S} s\n{report}"
    assert [p.returncode for p in procs] == [0] * nodes, report

    # Rank 0 (on whichever machine the rendezvous put it) printed; the other machine did not.
    stdouts = sorted((o for o, _ in texts), key=len)
    assert stdouts[0] == "", report
    assert (
        "shard train: preset tiny (0.11 M parameters) on 2 ranks (gloo, cpu), "
        "fully_shard, strategy full, fp32\n" in stdouts[1]
    ), report
    assert f"step {STEPS}/{STEPS} [########################] loss" in stdouts[1]

    summary = json.loads((run_dir / "summary.json").read_text("utf-8"))
    assert (summary["world_size"], summary["steps_run"]) == (2, STEPS)
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert summary["options"]["preset"] == "tiny"
    metrics = (run_dir / "metrics.jsonl").read_text("utf-8").splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [1, 2, 3]

    # Both machines wrote their shards into the one checkpoint, which is complete.
    assert inspect_checkpoint(run_dir / "checkpoint").world_size == 2
    assert read_step(run_dir / "checkpoint") == STEPS
    assert sorted(p.name for p in run_dir.iterdir() if "checkpoint" in p.name) == ["checkpoint"]
    assert sorted(p.name for p in (run_dir / "checkpoint").iterdir()) == [f"step-{STEPS}"]
    assert sorted(p.name for p in (run_dir / "checkpoint" / f"step-{STEPS}").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
