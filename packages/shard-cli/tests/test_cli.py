"""The ``shard`` command line in this process: plan's output, argument errors, the gpt shim."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from shard_cli.__main__ import main

ROOT = Path(__file__).resolve().parents[3]


def test_plan_json_for_the_tiny_preset(capsys: pytest.CaptureFixture[str]) -> None:
    """--json gives the units, the four strategies and one unsharded process."""
    assert (
        main(
            [
                "plan",
                "--preset",
                "tiny",
                "--world-size",
                "2",
                "--batch",
                "4",
                "--seq",
                "32",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert [u["name"] for u in report["units"]] == ["blocks.0", "blocks.1", ""]
    assert list(report["strategies"]) == ["full", "grad-op", "no-shard", "hybrid"]
    full, no_shard = report["strategies"]["full"], report["strategies"]["no-shard"]
    assert no_shard["params"] == report["unsharded"]["params"] == 4 * report["parameters"]
    assert full["params"] < no_shard["params"]
    assert report["note"] == ""


def test_plan_activation_checkpointing_keeps_only_block_inputs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--activation-checkpointing lowers the activations and the peak of every column and
    says so (the arithmetic itself: test_plan.py and test_train_flags.py)."""
    args = ["plan", "--preset", "tiny", "--world-size", "2", "--batch", "4", "--seq", "32"]
    assert main([*args, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--json", "--activation-checkpointing"]) == 0
    checkpointed = json.loads(capsys.readouterr().out)
    assert (plain["activation_checkpointing"], checkpointed["activation_checkpointing"]) == (
        False,
        True,
    )
    for strategy in ("full", "no-shard"):
        before, after = plain["strategies"][strategy], checkpointed["strategies"][strategy]
        assert after["activations"] < before["activations"]
        assert after["peak"] < before["peak"]
    assert main([*args, "--activation-checkpointing"]) == 0
    assert "per-rank memory (rank 0; batch 4 x seq 32, blocks checkpointed):" in (
        capsys.readouterr().out
    )


def test_plan_prints_a_tree_and_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    """The text form: the root, its blocks folded into one line, one row per memory kind."""
    assert main(["plan", "--preset", "gpt2", "--world-size", "64", "--strategy", "full"]) == 0
    out = capsys.readouterr().out
    assert "  (root) [GPT]  77.983 M params, 297.5 MiB  (tok_emb.weight, pos_emb.weight" in out
    assert "    blocks.0 .. blocks.11 (12x) [Block]  7.088 M params each" in out
    assert "  peak (estimate)" in out


def test_plan_shows_both_layouts_and_flat_columns(capsys: pytest.CaptureFixture[str]) -> None:
    """The layout table: dim-0, flat and wrapper against full/N; --flat changes the columns."""
    args = ["plan", "--preset", "gpt2-xl", "--world-size", "1024", "--strategy", "full"]
    assert main([*args, "--json"]) == 0
    dim0 = json.loads(capsys.readouterr().out)
    assert main([*args, "--json", "--flat"]) == 0
    flat = json.loads(capsys.readouterr().out)
    assert dim0["layouts"] == flat["layouts"]
    assert dim0["strategies"]["full"]["params"] == dim0["layouts"]["dim-0"]["params"]
    assert flat["strategies"]["full"]["params"] == flat["layouts"]["flat"]["params"]
    assert (flat["flat"], dim0["flat"]) == (True, False)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert (
        "per-rank state by layout (full, 1024 ranks; ideal = 1 process / 1024 = 24.4 MiB):" in out
    )
    assert "  ratio to ideal                     1.1581x       1.0002x       1.0000x" in out


def test_plan_passes_wrap_options_to_the_policy(capsys: pytest.CaptureFixture[str]) -> None:
    """--wrap-option KEY=VALUE reaches a registered policy (VALUE read as JSON) and is shown."""
    args = ["plan", "--preset", "small", "--world-size", "4", "--wrap-policy", "size"]
    assert main([*args, "--wrap-option", "min_num_params=100000", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["wrap_options"] == {"min_num_params": 100000}
    assert [u["name"] for u in report["units"]] == [
        "blocks.0.mlp",
        "blocks.1.mlp",
        "blocks.2.mlp",
        "",
    ]
    assert main([*args, "--wrap-option", "min_num_params=100000"]) == 0
    out = capsys.readouterr().out
    assert "; wrap policy size(min_num_params=100000); world size 4" in out


def test_plan_of_a_factory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--model module:factory plans any model; without an input no activations are counted."""
    (tmp_path / "toy_models.py").write_text(
        "from torch import nn\n\n"
        "def build():\n"
        "    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", "--model", "toy_models:build", "--wrap-policy", "none", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parameters"] == 8 * 8 + 8 + 8 * 2 + 2
    assert report["note"].startswith("activations not estimated: no example input")


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_plan_of_a_local_transformers_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A local config.json builds on the meta device; nothing is downloaded."""
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=64)
    config.to_json_file(str(tmp_path / "config.json"))
    assert main(["plan", "--hf-config", str(tmp_path), "--wrap-policy", "none", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["units"][0]["module_type"] == "GPT2LMHeadModel"
    assert (report["batch"], report["seq"]) == (1, 64)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--hf-config", "gpt2"], "is neither a local config.json"),
        (["plan", "--model", "nodots"], "write module:factory"),
        (
            ["plan", "--preset", "tiny", "--world-size", "6", "--shard-size", "4"],
            "--shard-size 4 does not divide",
        ),
        (["train", "--steps", "0"], "--steps must be at least 1, got 0"),
        (["train", "--wrap-policy", "bogus"], "--wrap-policy 'bogus' is not a registered"),
        (
            ["plan", "--wrap-policy", "size", "--wrap-option", "min_params=1"],
            "wrap policy 'size' does not take the options {'min_params': 1}: got an unexpected "
            "keyword argument 'min_params'; its options are: min_num_params=100000000",
        ),
        (
            ["plan", "--wrap-policy", "blocks", "--wrap-option", "x=1"],
            "--wrap-policy blocks takes no options, got --wrap-option x",
        ),
        (
            ["plan", "--wrap-policy", "size", "--wrap-option", "min_num_params"],
            "--wrap-option 'min_num_params': write KEY=VALUE, e.g. min_num_params=1000000",
        ),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Invalid input is one line on stderr and exit status 2, never a traceback."""
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--nproc-per-node", "--nproc"])
def test_train_takes_torchruns_nproc_per_node_and_the_nproc_alias(flag: str) -> None:
    """--nproc-per-node (torchrun's spelling) and --nproc both set the local ranks."""
    from shard_cli.__main__ import build_parser

    assert build_parser().parse_args(["train", flag, "3"]).nproc == 3
