"""``shard train --config FILE``: the flags of a run, written down in a TOML file.

[Note: config file keys]
Every flag of ``shard train`` is a key: the flag's name without its leading
dashes, dashes written as underscores (``--run-dir`` is ``run_dir``,
``--nproc-per-node`` is ``nproc_per_node``, its alias ``nproc`` works too).
A switch (``--resume``, ``--compile``) takes ``true`` or ``false`` (and
``--resume``, which may name what to resume from, also those names); every
other key takes the value the flag takes, as a TOML string, integer or
float; a repeatable flag (``--freeze``) takes a list of strings, or one
string. Flags given on the command line win over the file. Keys are checked
here, before any rank starts, against the very parser that reads the
command line, so a key the command line would not accept (an unknown name,
a value of the wrong type, a choice not offered) is an error naming the key
and the file. The file is not the run's record: rank 0 writes the resolved
options, whatever their source, to ``<run_dir>/config.json``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ConfigKey", "config_keys", "read_config_file"]

# Flags that are no option of the run: the file itself, and help.
_NOT_KEYS = frozenset({"config", "help"})


@dataclass(frozen=True)
class ConfigKey:
    """One key of a config file.

    Attributes:
        dest: The :class:`~shard_cli._options.TrainOptions` field it sets.
        kind: ``bool`` (a switch), ``int``, ``float``, ``str`` or ``list`` (a
            repeatable flag: a list of strings).
        choices: The values it may take; ``None``: any of its kind.
    """

    dest: str
    kind: type
    choices: tuple[Any, ...] | None


def config_keys(parser: argparse.ArgumentParser) -> dict[str, ConfigKey]:
    """The keys a config file may hold for ``parser``'s flags; see [Note: config file keys]."""
    keys: dict[str, ConfigKey] = {}
    for action in parser._actions:
        if isinstance(action, argparse._StoreTrueAction) or (
            action.nargs == "?" and action.const is True  # a switch that may name a choice
        ):
            kind: type = bool
        elif isinstance(action, argparse._AppendAction):
            kind = list
        elif action.type in (int, float):
            kind = action.type
        else:
            kind = str
        choices = tuple(action.choices) if action.choices is not None else None
        for flag in action.option_strings:
            if not flag.startswith("--"):
                continue
            name = flag[2:].replace("-", "_")
            if name not in _NOT_KEYS:
                keys[name] = ConfigKey(action.dest, kind, choices)
    return keys


def _toml_loads(text: str) -> dict[str, Any]:
    # tomllib from Python 3.11, its backport tomli before (a dependency there).
    module = importlib.import_module("tomllib" if sys.version_info >= (3, 11) else "tomli")
    data: dict[str, Any] = module.loads(text)
    return data


def _value(key: str, spec: ConfigKey, value: object, where: str) -> object:
    if spec.kind is bool:
        ok = isinstance(value, bool) or (spec.choices is not None and isinstance(value, str))
        what = "true or false"
        if spec.choices is not None:
            what += f", or one of {', '.join(map(str, spec.choices))}"
    elif spec.kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        what = "an integer"
    elif spec.kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value  # type: ignore[arg-type]
        what = "a number"
    elif spec.kind is list:
        value = [value] if isinstance(value, str) else value
        ok = isinstance(value, list) and all(isinstance(item, str) for item in value)
        what = "a list of strings"
    else:
        ok = isinstance(value, str)
        what = "a string"
    if not ok:
        raise ValueError(f"{where}: {key} must be {what}, got {value!r}")
    if spec.choices is not None and not isinstance(value, bool) and value not in spec.choices:
        allowed = ", ".join(map(str, spec.choices))
        raise ValueError(f"{where}: {key} must be one of {allowed}, got {value!r}")
    return value


def read_config_file(path: str | Path, keys: dict[str, ConfigKey]) -> dict[str, object]:
    """The options ``path`` sets, by field name, each checked; see [Note: config file keys].

    Raises:
        ValueError: the file is missing or not TOML, or holds a key that is no
            flag of ``shard train`` or a value the flag would refuse (the
            message names the key and the file).
    """
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--config {str(path)!r}: cannot read it ({exc.strerror})") from exc
    try:
        data = _toml_loads(text)
    except ValueError as exc:  # tomllib.TOMLDecodeError is a ValueError
        raise ValueError(f"--config {str(path)!r} is not valid TOML: {exc}") from exc
    options: dict[str, object] = {}
    for key, value in data.items():
        spec = keys.get(key)
        if spec is None:
            hint = key.replace("-", "_")
            fix = (
                f"write it {hint!r} (keys spell dashes as underscores)"
                if hint in keys
                else "keys are the flags of shard train --help without the dashes, "
                "e.g. run_dir for --run-dir"
            )
            raise ValueError(f"{path}: unknown key {key!r}; {fix}")
        if spec.dest in options:
            raise ValueError(f"{path}: {key} sets {spec.dest} a second time (alias of another key)")
        options[spec.dest] = _value(key, spec, value, str(path))
    return options
