"""``shard train --config FILE``: TOML keys are the flags, checked; the command line wins."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shard_cli.__main__ import _with_config_file, main, train_parser
from shard_cli._config_file import config_keys, read_config_file
from shard_cli._options import TrainOptions, resolve_options


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_every_flag_of_shard_train_is_a_key() -> None:
    """Each long flag but --config and --help has a key: its name with underscores."""
    keys = config_keys(train_parser())
    flags = {
        flag[2:].replace("-", "_")
        for action in train_parser()._actions
        for flag in action.option_strings
        if flag.startswith("--") and flag not in ("--config", "--help")
    }
    assert set(keys) == flags
    assert {"run_dir", "nproc_per_node", "nproc", "grad_accum", "clip_grad_norm"} <= set(keys)
    assert "config" not in keys


def test_keys_set_the_options_their_flags_set(tmp_path: Path) -> None:
    """Keys map to the fields their flags do (heads -> n_heads, timeout -> timeout_s), typed."""
    path = _write(
        tmp_path,
        'preset = "tiny"\nheads = 2\nlayers = 1\ntimeout = 30\nnproc_per_node = 3\n'
        "lr = 1\nactivation_checkpointing = true\nclip_grad_norm = 1.5\n"
        'lr_schedule = "cosine"\n',
    )
    assert read_config_file(path, config_keys(train_parser())) == {
        "preset": "tiny",
        "n_heads": 2,
        "n_layers": 1,
        "timeout_s": 30.0,
        "nproc": 3,
        "lr": 1.0,
        "activation_checkpointing": True,
        "clip_grad_norm": 1.5,
        "lr_schedule": "cosine",
    }


def test_command_line_flags_win_over_the_file(tmp_path: Path) -> None:
    """steps and lr from the file, steps again on the command line: the command line's wins."""
    path = _write(tmp_path, "steps = 10\nlr = 0.5\ngrad_accum = 4\n")
    given = _with_config_file({"config": str(path), "steps": 3})
    assert given == {"steps": 3, "lr": 0.5, "grad_accum": 4}
    options = resolve_options(given)
    assert (options.steps, options.lr, options.grad_accum) == (3, 0.5, 4)
    assert options.preset == TrainOptions.preset


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "learning_rate = 0.1\n",
            "unknown key 'learning_rate'; keys are the flags of shard train --help without "
            "the dashes, e.g. run_dir for --run-dir",
        ),
        (
            'run-dir = "x"\n',
            "unknown key 'run-dir'; write it 'run_dir' (keys spell dashes as underscores)",
        ),
        ('steps = "10"\n', "steps must be an integer, got '10'"),
        ("steps = true\n", "steps must be an integer, got True"),
        ("lr = true\n", "lr must be a number, got True"),
        (
            "resume = 1\n",
            "resume must be true or false, or one of latest, latest-intact, got 1",
        ),
        ('resume = "newest"\n', "resume must be one of latest, latest-intact, got 'newest'"),
        ("compile = 1\n", "compile must be true or false, got 1"),
        ("data = 3\n", "data must be a string, got 3"),
        ('frontend = "ddp"\n', "frontend must be one of fully_shard, wrapper, got 'ddp'"),
        ("[train]\nsteps = 3\n", "unknown key 'train'"),
        ("nproc = 2\nnproc_per_node = 2\n", "nproc_per_node sets nproc a second time"),
    ],
)
def test_bad_keys_are_errors_naming_the_key_and_the_file(
    tmp_path: Path, text: str, message: str
) -> None:
    """Unknown keys, values of the wrong type and choices not offered name the key and file."""
    path = _write(tmp_path, text)
    with pytest.raises(ValueError, match="^" + re.escape(f"{path}: {message}")):
        read_config_file(path, config_keys(train_parser()))


def test_unreadable_or_invalid_files_are_errors(tmp_path: Path) -> None:
    """A missing file and a file that is not TOML say so, naming the file."""
    keys = config_keys(train_parser())
    with pytest.raises(ValueError, match=r"--config '.*nope.toml': cannot read it"):
        read_config_file(tmp_path / "nope.toml", keys)
    with pytest.raises(ValueError, match=r"--config '.*run.toml' is not valid TOML: "):
        read_config_file(_write(tmp_path, "steps = \n"), keys)


def test_shard_train_with_an_unknown_key_exits_2_before_launching(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """shard train --config with a typo prints one line naming key and file, starts no rank."""
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "stepz = 3\n")
    assert main(["train", "--config", "run.toml", "--run-dir", "out"]) == 2
    assert capsys.readouterr().err == (
        "shard train: run.toml: unknown key 'stepz'; keys are the flags of shard train --help "
        "without the dashes, e.g. run_dir for --run-dir\n"
    )
    assert not (tmp_path / "out").exists()


def test_file_values_are_checked_as_flags_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An out-of-range value from the file gets the flag's own error."""
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "grad_accum = 0\n")
    assert main(["train", "--config", "run.toml"]) == 2
    assert capsys.readouterr().err == "shard train: --grad-accum must be at least 1, got 0\n"


def test_help_documents_the_config_file_keys(capsys: pytest.CaptureFixture[str]) -> None:
    """shard train --help says how keys are spelled and lists every new option."""
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "dashes written as underscores" in out
    for flag in (
        "--config",
        "--warmup-steps",
        "--lr-schedule",
        "--min-lr",
        "--clip-grad-norm",
        "--grad-accum",
        "--activation-checkpointing",
        "--compile",
        "--tensorboard",
    ):
        assert flag in out
