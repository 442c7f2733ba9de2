"""shard train's training flags: range checks, resume rules, TensorBoard's extra, .bin vocabularies,
and the per-block forward wrapping of --activation-checkpointing."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from shard_cli.__main__ import main
from shard_cli._blocks import check_compiler, find_blocks, wrap_blocks
from shard_cli._options import RESUMABLE_CHANGES, TrainOptions, resolve_options
from shard_cli._tensorboard import TENSORBOARD_INSTALL, check_tensorboard
from shard_cli.gpt import GPT, GPTConfig


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"grad_accum": 0}, r"^--grad-accum must be at least 1, got 0$"),
        (
            {"steps": 5, "warmup_steps": 6},
            r"^--warmup-steps must be between 0 and --steps \(5\), got 6$",
        ),
        ({"warmup_steps": -1}, r"^--warmup-steps must be between 0 and --steps \(400\), got -1$"),
        (
            {"clip_grad_norm": -1.0},
            r"^--clip-grad-norm must be more than 0, got -1.0; leave it out to train without",
        ),
        ({"clip_grad_norm": 0.0}, r"^--clip-grad-norm must be more than 0, got 0.0"),
        ({"lr": 0.0}, r"^--lr must be more than 0, got 0.0$"),
        (
            {"lr_schedule": "linear"},
            r"^--lr-schedule must be one of constant, cosine, got 'linear'$",
        ),
        (
            {"lr_schedule": "cosine", "lr": 0.1, "min_lr": 0.2},
            r"^--min-lr must be between 0 and --lr \(0.1\), got 0.2$",
        ),
        (
            {"lr": 0.1, "min_lr": 0.01},
            r"^--min-lr 0.01 needs --lr-schedule cosine \(a constant schedule stays at --lr\)",
        ),
    ],
)
def test_bad_training_flags_are_errors_naming_the_flag(
    given: dict[str, object], message: str
) -> None:
    """Each out-of-range training flag is a ValueError naming it and the value seen."""
    with pytest.raises(ValueError, match=message):
        resolve_options(given)


def test_new_options_default_off_and_are_in_the_effective_config() -> None:
    """Defaults change nothing (constant lr, no clipping, one micro-batch); to_json has them all."""
    options = TrainOptions()
    stored = options.to_json()
    assert {k: stored[k] for k in stored if k not in TrainOptions.__dataclass_fields__} == {}
    assert {
        k: stored[k]
        for k in (
            "warmup_steps",
            "lr_schedule",
            "min_lr",
            "clip_grad_norm",
            "grad_accum",
            "activation_checkpointing",
            "compile",
            "tensorboard",
            "release_host_memory",
        )
    } == {
        "warmup_steps": 0,
        "lr_schedule": "constant",
        "min_lr": 0.0,
        "clip_grad_norm": None,
        "grad_accum": 1,
        "activation_checkpointing": False,
        "compile": False,
        "tensorboard": False,
        "release_host_memory": False,
    }
    assert TrainOptions.from_json(stored) == options


def _stored_run(tmp_path: Path, **fields: object) -> str:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    options = TrainOptions(run_dir=str(run_dir), **fields)  # type: ignore[arg-type]
    (run_dir / "config.json").write_text(json.dumps(options.to_json()), encoding="utf-8")
    return str(run_dir)


def test_resume_may_switch_checkpointing_compile_and_tensorboard_but_not_numerics(
    tmp_path: Path,
) -> None:
    """How blocks run and where metrics go may change on --resume; accumulation may not."""
    assert {"activation_checkpointing", "compile", "tensorboard"} <= RESUMABLE_CHANGES
    run_dir = _stored_run(tmp_path, grad_accum=2, steps=10)
    resumed = resolve_options(
        {"resume": True, "run_dir": run_dir, "activation_checkpointing": True, "steps": 20}
    )
    assert (resumed.activation_checkpointing, resumed.grad_accum, resumed.steps) == (True, 2, 20)
    with pytest.raises(ValueError, match=r"--resume: --grad-accum 4 differs from the interrupted"):
        resolve_options({"resume": True, "run_dir": run_dir, "grad_accum": 4})


def test_resume_of_a_cosine_run_keeps_its_steps(tmp_path: Path) -> None:
    """The cosine decays over --steps, so a resumed cosine run refuses another --steps."""
    run_dir = _stored_run(tmp_path, lr_schedule="cosine", steps=10)
    with pytest.raises(
        ValueError,
        match=r"^--resume: --steps 20 differs from the interrupted run's 10, over which its "
        r"cosine learning rate decays; a resumed cosine run keeps its --steps: drop --steps$",
    ):
        resolve_options({"resume": True, "run_dir": run_dir, "steps": 20})
    assert resolve_options({"resume": True, "run_dir": run_dir, "steps": 10}).steps == 10


def test_missing_tensorboard_is_an_error_naming_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without the tensorboard package, --tensorboard exits 2 before launching, saying
    pip install tensorboard (never shard-cli[...] from the index, an unrelated project)."""
    # None in sys.modules makes the import fail as if the package were not installed.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match="--tensorboard needs the tensorboard package"):
        check_tensorboard()
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--tensorboard", "--run-dir", "out"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "shard train: --tensorboard needs the tensorboard package, which is not installed: "
        f"{TENSORBOARD_INSTALL}\n"
    )
    assert TENSORBOARD_INSTALL.startswith("pip install tensorboard ")
    assert "pip install shard-cli" not in err
    assert not (tmp_path / "out").exists()


FACTORY = """
import torch
from torch import nn


def factory() -> nn.Module:
    return nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10))
"""


def test_bin_ids_beyond_the_models_vocabulary_are_refused_naming_file_and_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A .bin holding id 11 for a model of 10 logits exits 2 naming the file and the id."""
    np.array([1, 2, 11, 3] * 40, dtype=np.uint16).tofile(tmp_path / "ids.bin")
    (tmp_path / "ten_logits.py").write_text(FACTORY, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["train", "--model", "ten_logits:factory", "--data", "ids.bin"]) == 2
    assert capsys.readouterr().err == (
        "shard train: ten_logits:factory() has a vocabulary of 10 tokens but --data ids.bin "
        "holds token id 11; give the model a vocabulary of at least 12 (vocab_size in its "
        "config or factory), or check --data-dtype\n"
    )


def test_checkpointed_blocks_give_the_same_outputs_and_gradients() -> None:
    """--activation-checkpointing's wrapping changes no value, name or state-dict key."""
    config = GPTConfig(vocab_size=20, d_model=16, n_heads=2, n_layers=2, seq_len=8)
    torch.manual_seed(0)
    plain = GPT(config)
    torch.manual_seed(0)
    wrapped = GPT(config)
    wrap_blocks(
        find_blocks(wrapped, None, what="GPT", flags="x"), checkpointing=True, compile=False
    )
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    tokens = torch.randint(0, 20, (2, 8), generator=torch.Generator().manual_seed(1))
    for model in (plain, wrapped):
        model(tokens).square().mean().backward()  # type: ignore[no-untyped-call]
    assert torch.equal(wrapped(tokens), plain(tokens))
    for (name, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters(), strict=True):
        assert a.grad is not None
        assert b.grad is not None
        assert torch.equal(a.grad, b.grad), name


def test_a_model_without_blocks_is_refused() -> None:
    """A model with no repeated layers has nothing to checkpoint: the error names model and flag."""
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with pytest.raises(
        ValueError,
        match=r"^--compile: m\(\) has no blocks \(repeated layers\) that shard finds to apply",
    ):
        find_blocks(model, "transformer", what="m()", flags="--compile")


def test_compile_without_a_cpu_compiler_is_refused_before_launching(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--compile with $CXX not on PATH (and no GPU) exits 2 naming the compiler and the fix."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CXX", "no-such-compiler++")
    with pytest.raises(ValueError, match=r"'no-such-compiler\+\+' \(from \$CXX, default g\+\+\)"):
        check_compiler()
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--compile", "--run-dir", "out"]) == 2
    assert capsys.readouterr().err == (
        "shard train: --compile on the CPU needs a C++ compiler for torch.compile, and "
        "'no-such-compiler++' (from $CXX, default g++) is not on PATH; install one "
        "(apt-get install g++) or set CXX to it, or drop --compile\n"
    )
    assert not (tmp_path / "out").exists()


def test_the_plan_line_counts_checkpointed_blocks_by_their_inputs() -> None:
    """shard train's memory prediction under --activation-checkpointing keeps each block's
    input instead of its saved activations (the root's stay), and so predicts less."""
    from shard_cli._activations import lm_activation_profile
    from shard_cli._model_source import load_model_source
    from shard_cli._train import predict

    overrides: dict[str, int | None] = {"n_layers": 2, "d_model": 32, "n_heads": 2}
    source = load_model_source(preset="small", overrides=overrides)
    given: dict[str, Any] = {"batch": 2, "seq": 16, **overrides}
    plain, _ = predict(source, resolve_options(given), world=2)
    checkpointed, alone = predict(
        source, resolve_options({**given, "activation_checkpointing": True}), world=2
    )
    assert source.vocab_size is not None
    profile = lm_activation_profile(
        source.build, ["", "blocks.0", "blocks.1"], batch=2, seq=16, vocab_size=source.vocab_size
    )
    blocks = ["blocks.0", "blocks.1"]
    assert plain.activations == profile.total
    assert checkpointed.activations == profile.kept(blocks) == alone.activations
    assert checkpointed.activations == profile.saved[""] + 2 * (2 * 16 * 32 * 4)
    assert checkpointed.peak < plain.peak
