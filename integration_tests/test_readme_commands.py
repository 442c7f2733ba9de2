"""The commands README.md shows, beyond the quick start (which CI runs), work as printed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from torch import nn

from shard_cli.__main__ import main as shard_main
from shard_core import plan_wraps
from shard_runtime import resolve_wrap_policy

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_shard_plan_command_prints_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """`shard plan --preset gpt2 --world-size 1024` prints units and per-rank memory."""
    command = re.search(r"`(shard plan [^`]+)`", README)
    assert command is not None
    assert shard_main(command.group(1).split()[1:]) == 0
    out = capsys.readouterr().out
    assert "blocks.0 .. blocks.11 (12x) [Block]" in out
    assert "world size 1024" in out


def test_plugin_example_policy_is_selectable_as_shown() -> None:
    """The README's name_pattern example resolves through the real entry point and picks units."""
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
    policy = resolve_wrap_policy(("name_pattern", {"pattern": r"layers\.\d+"}))
    assert [t.name for t in plan_wraps(model, policy)] == ["layers.0", "layers.1", ""]
    assert 'auto_wrap_policy=("name_pattern", {"pattern": r"layers\\.\\d+"})' in README
