"""The commands README.md shows, beyond the quick start (which CI runs), work as printed."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from torch import nn

from shard_core import plan_wraps
from shard_runtime.plumbing import resolve_wrap_policy

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
# What the installed `shard` command runs: shard-cli's console script.
(SHARD_COMMAND,) = entry_points(group="console_scripts", name="shard")
shard_main = SHARD_COMMAND.load()


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


def _own_model_commands() -> list[list[str]]:
    section = README[README.index("## Your own model") : README.index("### Training options")]
    lines = re.findall(r"^python -m hatch run dev:train (.+)$", section, flags=re.MULTILINE)
    return [line.split() for line in lines]


def test_own_model_section_shows_an_hf_config_and_a_factory_command() -> None:
    """The section a new user copies from names the shipped Llama config and the example model."""
    commands = _own_model_commands()
    assert [args[:2] for args in commands] == [
        ["--hf-config", "examples/llama/config.json"],
        ["--model", "examples/own_model/tiny_lm.py:build"],
    ]


@pytest.mark.parametrize("args", _own_model_commands(), ids=lambda args: args[0].lstrip("-"))
def test_own_model_commands_train_from_a_fresh_checkout(args: list[str], tmp_path: Path) -> None:
    """Each README command trains as printed (two steps instead of twenty), from the checkout."""
    steps = args.index("--steps")
    shortened = [*args[: steps + 1], "2", *args[steps + 2 :]]
    result = subprocess.run(
        [sys.executable, "-m", "shard_cli", "train", *shortened, "--run-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(math.isfinite(m["loss"]) for m in metrics)
