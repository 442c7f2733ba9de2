"""Resolving ``shard train``'s flags: preset defaults, validation, and what a resume may change."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from shard_cli import PRESETS, TrainOptions, get_preset, resolve_options


def test_a_new_run_takes_steps_batch_seq_lr_from_the_preset() -> None:
    """Flags not given come from the preset; given ones win."""
    options = resolve_options({"preset": "tiny", "batch": 3})
    tiny = PRESETS["tiny"]
    assert (options.steps, options.batch, options.seq, options.lr) == (
        tiny.steps,
        3,
        tiny.seq_len,
        tiny.lr,
    )
    assert options.checkpoint_path == Path("runs/shard-train/checkpoint")


def test_the_defaults_are_the_small_preset() -> None:
    """``shard train`` with no flags trains the small preset on two ranks."""
    options = resolve_options({})
    assert (options.preset, options.nproc, options.steps, options.batch) == ("small", 2, 400, 16)
    assert dataclasses.replace(options) == TrainOptions()


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            {"strategy": "zero3"},
            r"--strategy must be one of full, grad-op, no-shard, hybrid, got 'zero3'",
        ),
        ({"steps": 0}, r"--steps must be at least 1, got 0"),
        ({"preset": "huge"}, r"unknown preset 'huge'; presets are tiny, small, gpt2"),
        ({"ckpt_every": -1}, r"--ckpt-every must be 0 \(only at the end\) or more, got -1"),
        (
            {"max_restarts": -1},
            r"--max-restarts must be 0 \(a failed rank ends the run\) or more, got -1",
        ),
        ({"model": "a:b", "hf_config": "c.json"}, r"give one model, got --model and --hf-config"),
        (
            {"model": "a:b", "n_layers": 4},
            r"--layers size the preset's GPT, not --model or --hf-config; size your own model",
        ),
        ({"data_dtype": "int8"}, r"--data-dtype must be uint16 or uint32, got 'int8'"),
    ],
)
def test_bad_flags_are_errors_naming_the_flag(given: dict[str, object], message: str) -> None:
    """Each out-of-range flag is a ValueError naming it and the value seen."""
    with pytest.raises(ValueError, match=message):
        resolve_options(given)


def _stored(tmp_path: Path) -> TrainOptions:
    options = TrainOptions(preset="tiny", steps=6, run_dir=str(tmp_path), ckpt_every=3)
    (tmp_path / "config.json").write_text(json.dumps(options.to_json()), encoding="utf-8")
    return options


def test_resume_continues_the_stored_run_with_more_steps(tmp_path: Path) -> None:
    """--resume loads config.json and takes only the changes a resume may make."""
    stored = _stored(tmp_path)
    options = resolve_options({"resume": True, "run_dir": str(tmp_path), "steps": 9, "seed": 0})
    assert options == dataclasses.replace(stored, resume=True, steps=9)


def test_resume_refuses_to_change_what_the_run_depends_on(tmp_path: Path) -> None:
    """A resume that changes the data (here the world size) is refused, naming the flag."""
    _stored(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"--resume: --nproc 3 differs from the interrupted run's 2 \(config.json\); a "
        r"resumed run keeps the model, data, precision and world size of its checkpoint: "
        r"drop --nproc$",
    ):
        resolve_options({"resume": True, "run_dir": str(tmp_path), "nproc": 3})


def test_resume_may_switch_front_end_and_strategy(tmp_path: Path) -> None:
    """Checkpoints reshard on load, so a resume may change the front end and the strategy.

    (And how many restarts it allows, which the checkpoint does not depend on.)
    """
    stored = _stored(tmp_path)
    changes = {"frontend": "wrapper", "strategy": "grad-op", "cpu_offload": True, "max_restarts": 2}
    options = resolve_options({"resume": True, "run_dir": str(tmp_path), **changes})
    assert options == dataclasses.replace(stored, resume=True, **changes)


def test_resume_without_a_run_says_how_to_start_one(tmp_path: Path) -> None:
    """--resume in a directory with no config.json is an error naming the file."""
    with pytest.raises(FileNotFoundError, match=r"config.json does not exist; start the run first"):
        resolve_options({"resume": True, "run_dir": str(tmp_path / "none")})


def test_preset_config_needs_a_vocabulary_for_char_presets() -> None:
    """Character presets take the vocabulary from the corpus; GPT-2 sizes have their own."""
    assert get_preset("gpt2").config().vocab_size == 50257
    with pytest.raises(ValueError, match=r"preset 'tiny' uses the corpus' character vocabulary"):
        get_preset("tiny").config()
    assert get_preset("tiny").config(vocab_size=90, n_layers=5).n_layers == 5


def test_resume_refuses_another_model_source(tmp_path: Path) -> None:
    """The model source is recorded in config.json; resuming with another is refused."""
    options = TrainOptions(model="pkg.mod:factory", run_dir=str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(options.to_json()), encoding="utf-8")
    with pytest.raises(ValueError, match=r"--resume: --model pkg.other:factory differs"):
        resolve_options({"resume": True, "run_dir": str(tmp_path), "model": "pkg.other:factory"})
