"""Run one benchmark case in fresh processes and collect what each rank reports.

Benchmarks start every case in new processes (spawn) so that no case inherits
another's allocator state, threads or compiled code. Each rank puts one
result on the queue it is given; a rank that dies before reporting stops the
case with its exit status (its traceback is already on stderr).
"""

from __future__ import annotations

from collections.abc import Callable
from queue import Empty
from typing import Any

import torch.multiprocessing as mp


def run_ranks(
    name: str,
    world: int,
    target: Callable[..., None],
    args_for: Callable[[int, Any], tuple[Any, ...]],
) -> list[Any]:
    """Start ``target(*args_for(rank, queue))`` on ``world`` spawned ranks; their results.

    Results come back in the order ranks report them; callers sort by rank.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    results: list[Any] = []
    procs = [ctx.Process(target=target, args=args_for(rank, queue)) for rank in range(world)]
    for proc in procs:
        proc.start()
    try:
        while len(results) < world:
            try:
                results.append(queue.get(timeout=1.0))
            except Empty:
                failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode]
                if failed:
                    rank, code = failed[0]
                    raise RuntimeError(
                        f"{name}: rank {rank} exited with status {code} before reporting; "
                        "its traceback is above"
                    ) from None
        for proc in procs:
            proc.join()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join()
    return results
