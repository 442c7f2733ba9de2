"""``--comm-quant`` of ``shard train`` and ``shard plan``: parsing, the run's config, the output.

One short two-rank ``shard train --comm-quant weights,grads=int4`` checks the
wiring end to end: the summary's counted bytes per step are the ones ``shard
plan --comm-quant`` prints, a quarter (weights) and an eighth (gradients) of
float32 plus the block scales.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shard_cli import TrainOptions, resolve_options
from shard_cli.__main__ import main
from shard_cli._comm_quant import check_comm_quant, parse_comm_quant
from shard_cli._options import RESUMABLE_CHANGES


@pytest.mark.parametrize(
    ("given", "parts"),
    [
        ("weights,grads", ("weights=int8", "grads=int8")),
        ("grads, weights", ("weights=int8", "grads=int8")),
        ("grads=int4", ("grads=int4",)),
        ("weights=int8,grads=int4", ("weights=int8", "grads=int4")),
        (["grads=int4", "weights"], ("weights=int8", "grads=int4")),
        ("none", ()),
        ("", ()),
        (None, ()),
    ],
)
def test_parts_are_normalised(given: object, parts: tuple[str, ...]) -> None:
    """Sides in a fixed order, each with its codec (int8 unless named); none is nothing."""
    assert parse_comm_quant(given) == parts


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            "activations",
            r"^--comm-quant: 'activations' is not a part; use weights, grads or both "
            r"\(weights,grads\), each optionally =CODEC \(grads=int4\), or none$",
        ),
        ("grads,grads=int4", r"^--comm-quant names grads twice \('grads,grads=int4'\); name it"),
        (3, r"^--comm-quant takes parts such as weights,grads, got 3$"),
    ],
)
def test_bad_parts_name_the_flag_and_the_fix(given: object, message: str) -> None:
    """A part that is no side, a side given twice, or not text at all is a ValueError."""
    with pytest.raises(ValueError, match=message):
        parse_comm_quant(given)


def test_the_run_config_holds_the_parts_and_a_resume_may_change_them(tmp_path: Path) -> None:
    """config.json stores the normalised parts; --resume may switch quantization."""
    options = resolve_options({"comm_quant": "weights,grads"})
    assert options.comm_quant == ("weights=int8", "grads=int8")
    assert TrainOptions().comm_quant == ()
    stored = json.loads(json.dumps(options.to_json()))
    assert stored["comm_quant"] == ["weights=int8", "grads=int8"]
    assert TrainOptions.from_json(stored) == options
    assert "comm_quant" in RESUMABLE_CHANGES
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(stored), encoding="utf-8")
    resumed = resolve_options({"resume": True, "run_dir": str(run_dir), "comm_quant": "none"})
    assert resumed.comm_quant == ()


def test_an_unregistered_codec_is_refused_before_launching(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A codec no plugin registers stops shard train with the install hint; nothing starts."""
    with pytest.raises(LookupError, match=r"^--comm-quant grads=int3: no comm codec is"):
        check_comm_quant(("grads=int3",))
    assert main(["train", "--comm-quant", "grads=int3", "--run-dir", "/nonexistent/r"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "shard train: --comm-quant grads=int3: no comm codec is registered as 'int3' "
        "(registered: int4, int8); install shard-comm-quant from the shard repository "
        "(pip install ./plugins/shard-comm-quant), which registers int8 and int4\n"
    )


def test_plan_prints_bytes_per_step_with_and_without(capsys: pytest.CaptureFixture[str]) -> None:
    """shard plan --comm-quant adds the quantized bytes, the float32 ones and their ratio."""
    assert (
        main(["plan", "--preset", "tiny", "--strategy", "full", "--comm-quant", "weights,grads"])
        == 0
    )
    out = capsys.readouterr().out
    section = out[out.index("communication per step") :].splitlines()
    assert section[0] == (
        "communication per step (rank 0, --comm-quant weights=int8,grads=int8; bytes of each "
        "collective's buffer, as shard counts them):"
    )
    labels = [line[:30].strip() for line in section[2:8]]
    assert labels == [
        "all-gather",
        "reduce-scatter",
        "all-reduce (replicas)",
        "total",
        "without --comm-quant",
        "ratio",
    ]
    assert section[7].split()[-1] == "0.255x"  # 1/4 + 4 bytes per 256 values, plus padding


def test_train_sends_what_the_plan_says(tmp_path: Path) -> None:
    """Two ranks with --comm-quant weights,grads=int4 count the plan's bytes; the loss falls.

    --release-host-memory rides along (it changes no value): the run says it and keeps it."""
    tiny = ["--preset", "tiny", "--batch", "4", "--seq", "32"]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "shard_cli",
            "train",
            *tiny,
            "--steps",
            "3",
            "--sample-chars",
            "0",
            "--comm-quant",
            "weights,grads=int4",
            "--release-host-memory",
            "--run-dir",
            "r",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (
        "quantized communication (weights=int8, grads=int4), host memory released after every "
        "backward" in result.stdout
    )
    summary = json.loads((tmp_path / "r" / "summary.json").read_text("utf-8"))
    assert summary["options"]["comm_quant"] == ["weights=int8", "grads=int4"]
    assert summary["options"]["release_host_memory"] is True
    assert summary["last_loss"] < summary["first_loss"]
    plan = subprocess.run(
        [
            sys.executable,
            "-m",
            "shard_cli",
            "plan",
            *tiny,
            "--world-size",
            "2",
            "--strategy",
            "full",
            "--comm-quant",
            "weights,grads=int4",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    planned = json.loads(plan.stdout)["comm_per_step"]["full"]
    counted = {k: v["bytes"] for k, v in summary["comm_per_step"].items() if k != "broadcast"}
    assert counted == planned["quantized"]
    assert sum(counted.values()) < 0.3 * sum(planned["plain"].values())
