"""The SHARD_DEBUG=detail forward-order check: one order passes, another fails on every rank."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shard_runtime._order import ForwardOrderChecker, order_check_enabled
from shard_testing import RankPool

_UNITS = ["embed", "layers.0", "layers.1", "head"]
_SWAPPED = ["embed", "layers.1", "layers.0", "head"]
_ADVICE = (
    "Every rank must run the same units in the same order, or their all-gathers pair up wrongly "
    "and training hangs or mixes parameters; look for a data-dependent branch that skips or "
    "reorders a module on some ranks."
)


@contextlib.contextmanager
def _counting() -> Iterator[Counter[str]]:
    """Count the checker's collectives by wrapping them in ``torch.distributed``."""
    counts: Counter[str] = Counter()
    originals = {name: getattr(dist, name) for name in ("all_gather", "all_gather_object")}

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(dist, name, counted(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _run(
    orders: list[list[list[str]]], env: list[str | None], ranks: list[int] | None = None
) -> dict[str, Any]:
    """Run ``orders[rank][iteration]`` through one checker, with ``env[iteration]`` as SHARD_DEBUG.

    Each ``record`` is followed by a stand-in for the unit's all-gather (an
    all-reduce through the same group). With ``ranks``, the checker uses a
    group of those ranks and the other ranks only help create it.
    """
    group = dist.new_group(ranks) if ranks is not None else None
    rank = dist.get_rank()
    result: dict[str, Any] = {"error": None, "warnings": [], "stand_ins": 0}
    saved = os.environ.get("SHARD_DEBUG")
    try:
        if ranks is not None and rank not in ranks:
            return result
        checker = ForwardOrderChecker(group)
        with warnings.catch_warnings(record=True) as caught, _counting() as counts:
            warnings.simplefilter("always")
            try:
                for iteration, labels in enumerate(orders[rank]):
                    value = env[iteration]
                    if value is None:
                        os.environ.pop("SHARD_DEBUG", None)
                    else:
                        os.environ["SHARD_DEBUG"] = value
                    for label in labels:
                        checker.record(label)
                        dist.all_reduce(torch.ones(1), group=group)
                        result["stand_ins"] += 1
                    checker.end_iteration()
            except RuntimeError as exc:
                result["error"] = str(exc)
        result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
        result["all_gathers"] = counts["all_gather"]
        result["all_gather_objects"] = counts["all_gather_object"]
        return result
    finally:
        if saved is None:
            os.environ.pop("SHARD_DEBUG", None)
        else:
            os.environ["SHARD_DEBUG"] = saved
        if group is not None:
            dist.destroy_process_group(group)


@pytest.mark.parametrize("world_size", [2, 3])
def test_same_order_passes_and_checks_first_iteration_only(
    rank_pool: RankPool, world_size: int
) -> None:
    """The same order on every rank passes; only the first iteration exchanges (4 units + end)."""
    orders = [[_UNITS] * 3] * world_size
    results = rank_pool.run(_run, world_size, orders, ["detail"] * 3)
    assert (
        results
        == [
            {
                "error": None,
                "warnings": [],
                "stand_ins": 12,
                "all_gathers": 5,
                "all_gather_objects": 0,
            }
        ]
        * world_size
    )


def test_swapped_order_raises_on_every_rank_before_the_unit_all_gather(
    rank_pool: RankPool,
) -> None:
    """Rank 1 swapping two units raises the same error on both ranks before either all-gathers."""
    results = rank_pool.run(_run, 2, [[_UNITS], [_SWAPPED]], ["detail"])
    message = (
        "Forward order differs across ranks at unit position 1 of the first iteration (after 1 "
        "unit(s) in the same order): rank 0 runs 'layers.0', rank 1 runs 'layers.1'. " + _ADVICE
    )
    assert (
        results
        == [
            {
                "error": message,
                "warnings": [],
                "stand_ins": 1,
                "all_gathers": 2,
                "all_gather_objects": 1,
            }
        ]
        * 2
    )


def test_missing_unit_is_named_on_every_rank(rank_pool: RankPool) -> None:
    """A rank that ends its iteration early is reported at the first unit it skipped."""
    orders = [[_UNITS], [_UNITS], [_UNITS[:2]]]
    results = rank_pool.run(_run, 3, orders, ["detail"])
    message = (
        "Forward order differs across ranks at unit position 2 of the first iteration (after 2 "
        "unit(s) in the same order): rank 0 runs 'layers.1', rank 1 runs 'layers.1', rank 2 "
        "runs no unit (its iteration ended). " + _ADVICE
    )
    assert [r["error"] for r in results] == [message] * 3
    assert [r["stand_ins"] for r in results] == [2, 2, 2]


def test_subgroup_mismatch_names_global_ranks(rank_pool: RankPool) -> None:
    """Through a group of ranks 1 and 2, the error names global ranks; rank 0 is not involved."""
    orders = [[], [["a", "b"]], [["b", "a"]]]
    results = rank_pool.run(_run, 3, orders, ["detail"], [1, 2])
    message = (
        "Forward order differs across ranks at unit position 0 of the first iteration (after 0 "
        "unit(s) in the same order): rank 1 runs 'a', rank 2 runs 'b'. " + _ADVICE
    )
    assert [r["error"] for r in results] == [None, message, message]


def test_later_deviation_warns_once_on_the_deviating_rank(rank_pool: RankPool) -> None:
    """After a matching first iteration, rank 1 changing its order warns once, with no exchange."""
    orders = [[_UNITS] * 3, [_UNITS, _SWAPPED, _SWAPPED]]
    rank0, rank1 = rank_pool.run(_run, 2, orders, ["detail"] * 3)
    assert rank0 == {
        "error": None,
        "warnings": [],
        "stand_ins": 12,
        "all_gathers": 5,
        "all_gather_objects": 0,
    }
    assert rank1["error"] is None
    assert rank1["all_gathers"] == 5
    assert rank1["warnings"] == [
        "UserWarning: Forward order differs from that of the first iteration on rank 1. "
        "Collectives are unchecked and may give incorrect results or hang: at unit position 1 "
        "this iteration runs 'layers.1' where the first ran 'layers.0'. Only the first "
        "iteration is checked across ranks (SHARD_DEBUG=detail or "
        "TORCH_DISTRIBUTED_DEBUG=DETAIL); if the other ranks did not change alike, all-gathers "
        "pair up wrongly. This warning is shown once."
    ]


@pytest.mark.parametrize(
    ("second", "position", "runs", "first_ran"),
    [
        (["a"], 1, "no unit (its iteration ended)", "'b'"),
        (["a", "b", "c"], 2, "'c'", "no unit (its iteration ended)"),
    ],
)
def test_later_length_change_warns_without_collectives_on_one_rank(
    rank_pool: RankPool, second: list[str], position: int, runs: str, first_ran: str
) -> None:
    """A later iteration with fewer or more units warns; a single rank issues no collective."""
    (result,) = rank_pool.run(_run, 1, [[["a", "b"], second]], ["detail"] * 2)
    assert result["all_gathers"] == 0
    assert result["warnings"] == [
        f"UserWarning: Forward order differs from that of the first iteration on rank 0. "
        f"Collectives are unchecked and may give incorrect results or hang: at unit position "
        f"{position} this iteration runs {runs} where the first ran {first_ran}. Only the first "
        f"iteration is checked across ranks (SHARD_DEBUG=detail or "
        f"TORCH_DISTRIBUTED_DEBUG=DETAIL); if the other ranks did not change alike, all-gathers "
        f"pair up wrongly. This warning is shown once."
    ]


def test_disabled_issues_no_collective_until_enabled(rank_pool: RankPool) -> None:
    """Without SHARD_DEBUG=detail nothing is exchanged; the first enabled iteration is checked."""
    orders = [[_UNITS] * 3, [_SWAPPED] * 3]
    results = rank_pool.run(_run, 2, orders, [None, "1", "detail"])
    message = (
        "Forward order differs across ranks at unit position 1 of the first iteration (after 1 "
        "unit(s) in the same order): rank 0 runs 'layers.0', rank 1 runs 'layers.1'. " + _ADVICE
    )
    assert (
        results
        == [
            {
                "error": message,
                "warnings": [],
                "stand_ins": 9,
                "all_gathers": 2,
                "all_gather_objects": 1,
            }
        ]
        * 2
    )


def test_disabled_checker_needs_no_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """A disabled checker never touches torch.distributed, so it runs without any process group."""
    assert not dist.is_initialized()
    monkeypatch.setenv("SHARD_DEBUG", "1")
    checker = ForwardOrderChecker(None)
    for labels in (_UNITS, _SWAPPED):
        for label in labels:
            checker.record(label)
        checker.end_iteration()
    monkeypatch.setenv("SHARD_DEBUG", "detail")
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        checker.record("embed")


@pytest.mark.parametrize(
    ("value", "enabled"),
    [(None, False), ("", False), ("0", False), ("1", False), ("detail", True), ("DETAIL", True)],
)
def test_order_check_enabled_reads_shard_debug(
    monkeypatch: pytest.MonkeyPatch, value: str | None, enabled: bool
) -> None:
    """Only SHARD_DEBUG=detail (any case) enables the check, read at each call."""
    if value is None:
        monkeypatch.delenv("SHARD_DEBUG", raising=False)
    else:
        monkeypatch.setenv("SHARD_DEBUG", value)
    assert order_check_enabled() is enabled
