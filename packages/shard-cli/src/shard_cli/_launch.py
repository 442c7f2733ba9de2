"""How ``shard train`` starts its ranks, and how it stops them all.

The launcher calls PyTorch's elastic launcher in-process
(``torch.distributed.run.main``, what ``torchrun`` runs) with
``--standalone --nproc-per-node N -m shard_cli train <the same flags>``: each
rank is ``python -m shard_cli train`` with ``RANK``/``WORLD_SIZE`` set, which
runs :func:`~shard_cli._train.run_worker`. Under ``torchrun`` on several
machines the user starts the same module the same way; nothing else differs.

[Note: stopping every rank]
- A rank that dies (killed, out of memory, an exception): the elastic agent
  sees it within its monitor interval and terminates every other rank of the
  job; the launcher then raises ``ChildFailedError``, which is reported here
  as one message naming the first rank that failed and how.
- Ctrl-C: the terminal sends SIGINT to the launcher and to every rank (one
  process group); ranks stop where they are, the agent terminates any that
  linger and raises ``SignalException``.
- A rank that stops answering without dying (a hung peer on another
  machine): every collective has the ``--timeout`` of the process group, so
  the waiting ranks fail with an error instead of hanging.
Either way checkpoints are written atomically (shard-checkpoint renames a
complete directory into place), so the last one completed is whole, and
the message says where it is and how to resume. Whole is not verified:
reading every byte of a large checkpoint at every failure would delay the
message, so it names ``shard ckpt inspect --verify`` instead, and
``--resume`` verifies as it loads (refusing a corrupt checkpoint, or
falling back under ``--resume latest-intact``).

With ``--max-restarts N`` the agent, instead of ending the job when a rank
dies, stops the others and starts every rank again, up to N times; the new
ranks resume from the last checkpoint on their own ([Note: restarts] in
``_train.py``). Only when the restarts are used up does the launcher raise
``ChildFailedError`` and the message above say so. The launcher gives its
ranks one ``SHARD_TRAIN_LAUNCH_ID`` for all attempts, which the checkpoints
record, so that a restart never resumes from an earlier run's checkpoint.

[Note: the launcher's store]
The launcher hosts the ranks' c10d store (a TCPStore in this process, as
torchrun's agent hosts its own) and gives them its address in
``SHARD_STORE_ENDPOINT``; ``init_distributed`` rendezvouses through it under
one prefix per attempt (shard-comms' [Note: A store that outlives every
rank]). So the store outlives every rank, rank 0 included, and a survivor
can always read its peers' flight records and name the dead rank; and a
restart's ranks never read the dead attempt's addresses (the agent's own
shared store, kept across restarts without such a prefix, makes restarted
ranks fail to connect: pytorch/pytorch#135712).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid

from shard_cli._options import TrainOptions
from shard_cli._train_checkpoint import LAUNCH_ENV, read_step
from shard_comms.plumbing import SHARD_STORE_ENV

__all__ = ["is_launched_rank", "launch", "stopped_message"]

# Exit status of a run stopped by Ctrl-C (128 + SIGINT), as shells report it.
INTERRUPTED = 130


def is_launched_rank() -> bool:
    """Whether this process is a rank started by ``torchrun`` or the launcher."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def stopped_message(options: TrainOptions, cause: str) -> str:
    """What to tell the user when the run stopped early: why, the last checkpoint, how to go on."""
    path = options.checkpoint_path
    step = read_step(path)
    lines = [f"shard train: stopped: {cause}; every rank was stopped."]
    if step is None:
        lines.append(f"no checkpoint was completed at {path} (use --ckpt-every to save sooner).")
    else:
        lines.append(
            f"last checkpoint: {path} (step {step}, complete; "
            f"`shard ckpt inspect --verify {path}` checks its checksums)."
        )
        lines.append(f"continue with: shard train --resume --run-dir {options.run_dir}")
    return "\n".join(lines)


def _describe(rank: int, failure: object) -> str:
    exitcode = getattr(failure, "exitcode", None)
    if isinstance(exitcode, int) and exitcode < 0:
        return f"rank {rank} was killed by {signal.Signals(-exitcode).name}"
    if exitcode == INTERRUPTED:
        return f"rank {rank} was interrupted"
    return f"rank {rank} exited with status {exitcode}"


def _failure_cause(error: BaseException) -> str:
    """The rank that failed first, and how: a killed rank before the ones that then lost it."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return f"{type(error).__name__}: {error}"

    def order(rank: int) -> tuple[int, float]:
        exitcode = getattr(failures[rank], "exitcode", 0)
        killed = isinstance(exitcode, int) and exitcode < 0
        return (0 if killed else 1, float(getattr(failures[rank], "timestamp", 0)))

    ranks = sorted(failures, key=order)
    cause = _describe(ranks[0], failures[ranks[0]])
    others = [_describe(r, failures[r]) for r in ranks[1:]]
    return cause + (f" (then {', '.join(others)})" if others else "")


def launch(options: TrainOptions, argv: list[str]) -> int:
    """Run ``shard train`` on ``options.nproc`` local ranks; the exit status.

    ``argv`` are the flags the ranks receive (the command line as given), so
    each rank resolves the same options. See [Note: stopping every rank].
    """
    from torch._C._distributed_c10d import TCPStore
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    if not os.environ.get("SHARD_DEBUG"):
        # The agent's own warnings and errors repeat what the message below says.
        for name in list(logging.root.manager.loggerDict):
            if name.startswith("torch.distributed.elastic"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    cores = os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // options.nproc)))
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    args = [
        "--standalone",
        f"--nproc-per-node={options.nproc}",
        f"--max-restarts={options.max_restarts}",
        "--monitor-interval=0.5",
        "-m",
        "shard_cli",
        "train",
        *argv,
    ]
    # See [Note: the launcher's store]; it closes when the launch returns.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # The ranks inherit these; restored afterwards for callers that launch in-process.
    previous = {name: os.environ.get(name) for name in (LAUNCH_ENV, SHARD_STORE_ENV)}
    os.environ[LAUNCH_ENV] = uuid.uuid4().hex
    os.environ[SHARD_STORE_ENV] = f"127.0.0.1:{store.port}"
    try:
        torchrun(args)
    except ChildFailedError as error:
        cause = _failure_cause(error)
        if options.max_restarts:
            runs = "restart" if options.max_restarts == 1 else "restarts"
            cause += f", after {options.max_restarts} {runs} (--max-restarts)"
        print(stopped_message(options, cause), file=sys.stderr, flush=True)
        return 1
    except (SignalException, KeyboardInterrupt) as error:
        sig = getattr(error, "sigval", signal.SIGINT)
        cause = "interrupted (Ctrl-C)" if sig == signal.SIGINT else f"received {sig.name}"
        print("\n" + stopped_message(options, cause), file=sys.stderr, flush=True)
        return INTERRUPTED
    finally:
        del store
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return 0
