"""Under plain ``torchrun``, a SIGKILLed rank's survivor names it on the console.

When a rank dies, torchrun's agent sends SIGTERM to the others within its
monitor interval. Before shard-comms' SIGTERM handler ([Note: SIGTERM from a
launcher] in ``_terminate.py``) a survivor that had not yet failed a
collective ended at once, and the job's output named nothing but the
launcher's exit code. Two jobs of 2 gloo ranks run under the real
``torchrun`` at once (this file is their script), one per front end:

- ``fully_shard``: rank 1 is SIGKILLed in the optimizer step of step 3
  while rank 0 is busy in its own (a sleep), so the agent's SIGTERM (0.1 s
  monitor interval) reaches rank 0 before any collective fails: the
  handler exchanges records and names rank 1 and where it was last seen.
  The script names its steps (``set_training_step``), as ``shard train``
  does.
- ``FullyShardedDataParallel``: rank 1 is SIGKILLed in the forward of step 2
  and rank 0's next all-gather fails first; the agent's SIGTERM (a 3 s
  monitor interval here, so the order is certain) comes during the exchange
  of records, and the failure reaches the console before rank 0 ends.
  Steps are the runtime's count (0 in the first iteration).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

GRACE_S = "2"
FLIGHT_WAIT_S = "5"

# ----------------------------------------------------------------------------- rank side


def _rank_main(frontend: str) -> None:
    import torch
    from torch import nn

    import shard_comms as sc
    from shard_runtime import FullyShardedDataParallel, fully_shard

    state = sc.init_distributed()
    rank = state.rank
    torch.manual_seed(0)
    torch.set_num_threads(1)

    def die() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

        def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
            for index, layer in enumerate(self.layers):
                if frontend == "wrapper" and rank == 1 and step == 2 and index == 2:
                    die()  # layers.0 and layers.1 gathered, layers.2 not yet
                x = torch.tanh(layer(x))
            return x

    model: nn.Module = Net()
    if frontend == "fully_shard":
        for layer in model.layers:  # type: ignore[union-attr]
            fully_shard(layer)
        fully_shard(model)
        steps = range(1, 5)
    else:
        layers = model.layers  # type: ignore[union-attr]
        for index in range(len(layers)):
            layers[index] = FullyShardedDataParallel(layers[index])
        model = FullyShardedDataParallel(model)
        steps = range(4)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in steps:
        if frontend == "fully_shard":
            sc.set_training_step(step)
        model(torch.randn(4, 16), step).sum().backward()
        if frontend == "fully_shard" and step == 3:
            if rank == 1:
                die()
            time.sleep(60)  # a long optimizer step: the agent's SIGTERM comes in it
        optim.step()
        optim.zero_grad()
    os._exit(0)


if __name__ == "__main__":
    _rank_main(sys.argv[1])


# ----------------------------------------------------------------------------- test side


@pytest.fixture(scope="module")
def consoles(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, subprocess.CompletedProcess[str]]:
    """Both jobs, launched at once; what each torchrun printed and its exit status."""
    root = tmp_path_factory.mktemp("torchrun")
    env = {
        **os.environ,
        "SHARD_SIGTERM_GRACE_S": GRACE_S,
        "SHARD_FLIGHT_WAIT": FLIGHT_WAIT_S,
        "OMP_NUM_THREADS": "1",
    }
    env.pop("SHARD_STORE_ENDPOINT", None)
    jobs = {"fully_shard": ["--monitor-interval", "0.1"], "wrapper": ["--monitor-interval", "3"]}
    procs = {}
    logs = []
    for frontend, monitor in jobs.items():
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            *monitor,
            __file__,
            frontend,
        ]
        logs.append((root / f"{frontend}.out").open("w"))  # a file never blocks
        procs[frontend] = subprocess.Popen(
            command, cwd=root, env=env, stdout=logs[-1], stderr=subprocess.STDOUT, text=True
        )
    results = {}
    for frontend, proc in procs.items():
        try:
            code = proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        console = (root / f"{frontend}.out").read_text(errors="replace")
        results[frontend] = subprocess.CompletedProcess(proc.args, code, console, "")
    for log in logs:
        log.close()
    return results


def _lines(console: str, first: str) -> list[str]:
    """The block of lines that starts with ``first`` (its indented lines follow it)."""
    lines = console.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(first)), None)
    assert start is not None, console[-6000:]
    block = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        block.append(line)
    return block


def test_fully_shard_survivor_stopped_before_any_failure_names_the_dead_rank(
    consoles: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    """SIGTERM reaches rank 0 in its optimizer step: it names rank 1 and where it was last."""
    job = consoles["fully_shard"]
    assert job.returncode == 1, job.stdout[-6000:]
    assert _lines(job.stdout, "shard: rank 0 of 2 was stopped by SIGTERM") == [
        "shard: rank 0 of 2 was stopped by SIGTERM (its launcher ending the job) during step 3; "
        "its last collective: reduce-scatter of `layers.0` (reduce-scatter, step 3, seq 35) "
        "[completed]",
        "  rank 0 (this rank): last issued reduce-scatter of `layers.0` (reduce-scatter, step 3, "
        "seq 35) [completed]; last completed reduce-scatter of `layers.0` (reduce-scatter, step 3, "
        "seq 35)",
        "  did not answer: rank 1 (dead, or stuck outside a collective; no record in the c10d "
        "store after up to 2 s (SHARD_SIGTERM_GRACE_S))",
        "  rank 1 was last seen in the reduce-scatter of `layers.0` (reduce-scatter, step 3, "
        "seq 35), the last collective it completed with this rank",
        "  fix: find out what ended rank 1 (its own output; the launcher's exit code for it: "
        "SIGKILL is often the out-of-memory killer); set SHARD_FLIGHT_RECORDER_DUMP=DIR and "
        "run `shard debug flight DIR` for the full record",
    ]
    assert "exitcode  : -15" in job.stdout  # rank 0 still ended by SIGTERM


def test_wrapper_survivor_whose_collective_failed_first_writes_the_failure(
    consoles: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    """Rank 0's all-gather fails first; SIGTERM comes in the exchange; the failure is shown."""
    job = consoles["wrapper"]
    assert job.returncode == 1, job.stdout[-6000:]
    block = _lines(job.stdout, "collective failed on rank 0 of 2:")
    assert block[0].startswith(
        "collective failed on rank 0 of 2: all-gather of `layers.2` (forward all-gather, "
        "step 2, seq 26) raised RuntimeError: "
    ), block
    assert block[1:] == [
        "  rank 0 (this rank): last issued all-gather of `layers.2` (forward all-gather, "
        "step 2, seq 26) [failed]; last completed all-gather of `layers.1` (forward "
        "all-gather, step 2, seq 25)",
        "  did not answer: rank 1 (dead, or stuck outside a collective; no record in the c10d "
        "store after up to 5 s (SHARD_FLIGHT_WAIT))",
        "  rank 1 was last seen in the all-gather of `layers.1` (forward all-gather, step 2, "
        "seq 25), the last collective it completed with this rank; it did not complete the "
        "all-gather of `layers.2` (forward all-gather, step 2, seq 26)",
        "  fix: find out what ended rank 1 (its own output; the launcher's exit code for it: "
        "SIGKILL is often the out-of-memory killer); set SHARD_FLIGHT_RECORDER_DUMP=DIR and "
        "run `shard debug flight DIR` for the full record",
    ]
    assert "shard: rank 0 of 2 was stopped by SIGTERM:" in job.stdout
    assert "exitcode  : -15" in job.stdout
