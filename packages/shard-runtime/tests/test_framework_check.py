"""One warning when a framework that checks PyTorch's FSDP classes runs beside shard unintegrated.

The frameworks are stood in for by empty modules in ``sys.modules`` (the check
looks only there, and at accelerate's process state): importing Lightning or
torchtitan here would cost seconds and is done by ``test_frameworks.py``.
"""

from __future__ import annotations

import sys
import types
import warnings

import pytest
from torch import nn

from shard_core.errors import FrameworkIntegrationWarning
from shard_runtime import (
    FullyShardedDataParallel,
    _framework_check,
    fully_shard,
    use_shard_for_torch_fsdp,
)
from shard_runtime._framework_check import frameworks_in_use, warn_if_unintegrated
from shard_testing import RankPool


@pytest.fixture
def fresh_check(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No warning shown yet in this process, the check on, and no framework imported."""
    monkeypatch.setattr(_framework_check, "_WARNED", False)
    monkeypatch.delenv("SHARD_FRAMEWORK_CHECK", raising=False)
    for name in ("lightning", "torchtitan", "accelerate.state", "transformers.trainer"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return monkeypatch


def _user_call() -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_unintegrated("fully_shard", stacklevel=1)
    return list(caught)


def test_lightning_without_the_integration_warns_once_naming_what_it_misses(
    fresh_check: pytest.MonkeyPatch,
) -> None:
    """The warning names the framework, what it will not recognise, the fix and the switch,
    points at the caller's line, and is shown once per process."""
    fresh_check.setitem(sys.modules, "lightning", types.ModuleType("lightning"))
    (first,) = _user_call()
    assert first.category is FrameworkIntegrationWarning
    assert first.filename == __file__
    message = str(first.message)
    assert message.startswith(
        "shard's fully_shard runs in a process that uses Lightning, which recognises sharded "
        "modules by PyTorch's FSDP classes and will not recognise shard's without the integration."
    )
    assert "fabric.no_backward_sync would not skip the gradient reduction" in message
    assert "Call shard_runtime.use_shard_for_torch_fsdp() before the framework" in message
    assert message.endswith("SHARD_FRAMEWORK_CHECK=0 turns this check off.")
    assert _user_call() == []


def test_no_framework_no_warning(fresh_check: pytest.MonkeyPatch) -> None:
    """A process with none of the frameworks in use hears nothing."""
    assert frameworks_in_use() == []
    assert _user_call() == []


def test_the_switch_turns_the_check_off(fresh_check: pytest.MonkeyPatch) -> None:
    """SHARD_FRAMEWORK_CHECK=0 silences it."""
    fresh_check.setitem(sys.modules, "torchtitan", types.ModuleType("torchtitan"))
    fresh_check.setenv("SHARD_FRAMEWORK_CHECK", "0")
    assert _user_call() == []


def test_with_the_integration_on_there_is_nothing_to_say(fresh_check: pytest.MonkeyPatch) -> None:
    """While use_shard_for_torch_fsdp() is on, the frameworks see shard's classes."""
    fresh_check.setitem(sys.modules, "torchtitan", types.ModuleType("torchtitan"))
    with use_shard_for_torch_fsdp(late_bindings="ignore"):
        assert _user_call() == []
    assert [str(w.message).split(",")[0] for w in _user_call()] == [
        "shard's fully_shard runs in a process that uses torchtitan"
    ]


def test_accelerate_counts_once_its_state_exists(fresh_check: pytest.MonkeyPatch) -> None:
    """Importing accelerate (every Hugging Face model does) is not using it; its state is."""
    state = types.ModuleType("accelerate.state")
    state.PartialState = type("PartialState", (), {"_shared_state": {}})  # type: ignore[attr-defined]
    fresh_check.setitem(sys.modules, "accelerate.state", state)
    assert frameworks_in_use() == []
    state.PartialState._shared_state = {"backend": "gloo"}  # type: ignore[attr-defined]
    assert frameworks_in_use() == ["accelerate"]


def test_transformers_counts_with_its_trainer(fresh_check: pytest.MonkeyPatch) -> None:
    """A Hugging Face model alone is not the Trainer; transformers.trainer imported is."""
    fresh_check.setitem(sys.modules, "transformers.trainer", types.ModuleType("t"))
    assert frameworks_in_use() == ["transformers' Trainer"]


def _shard_beside_lightning(front_end: str) -> list[tuple[str, str, str]]:
    sys.modules.setdefault("lightning", types.ModuleType("lightning"))
    _framework_check._WARNED = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                if front_end == "fully_shard":
                    fully_shard(nn.Linear(4, 4))
                else:
                    FullyShardedDataParallel(
                        nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)),
                        auto_wrap_policy={nn.Linear},
                    )
    finally:
        del sys.modules["lightning"]
    return [(w.category.__name__, w.filename, str(w.message).split(" runs")[0]) for w in caught]


@pytest.mark.parametrize("front_end", ["fully_shard", "FullyShardedDataParallel"])
def test_both_front_ends_warn_once_at_the_users_line(rank_pool: RankPool, front_end: str) -> None:
    """Through the real front ends (the wrapper's auto-wrapped inner units included), once,
    at the line that called them."""
    assert rank_pool.run(_shard_beside_lightning, 1, front_end) == [
        [("FrameworkIntegrationWarning", __file__, f"shard's {front_end}")]
    ]
