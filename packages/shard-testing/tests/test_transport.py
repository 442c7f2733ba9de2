"""Tests of how functions travel to the ranks: by source file for test files, by name otherwise."""

from __future__ import annotations

import importlib.util
import operator
import os
import pickle
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from shard_testing import _pool
from shard_testing._transport import (
    load_source_modules,
    pickle_task,
    source_file_if_not_importable,
)

_PROBE_SOURCE = """
import dataclasses


@dataclasses.dataclass(frozen=True)
class Payload:
    value: int


def function() -> int:
    return 1
"""


@pytest.fixture
def module_names() -> Iterator[list[str]]:
    """Names a test loads into sys.modules; removed afterwards."""
    names: list[str] = []
    yield names
    for name in names:
        for loaded in [key for key in sys.modules if key == name or name.startswith(key + ".")]:
            sys.modules.pop(loaded, None)


@pytest.fixture
def probe(tmp_path: Path, module_names: list[str]) -> ModuleType:
    """A test file imported the way pytest's importlib mode does: under a name nobody can import."""
    path = tmp_path / "test_probe.py"
    path.write_text(_PROBE_SOURCE)
    name = "shard_testing_probe_test_module"
    module_names.append(name)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_source_file_of_a_module_loaded_from_its_path(probe: ModuleType) -> None:
    """A module imported from a file under a name no finder resolves is sent by its source file."""
    assert source_file_if_not_importable(probe.__name__) == probe.__file__


@pytest.mark.parametrize("name", ["shard_testing._pool", "operator", "_operator", "__main__"])
def test_importable_modules_travel_by_name(name: str) -> None:
    """Installed, standard-library, built-in and __main__ modules need no source file."""
    assert source_file_if_not_importable(name) is None


def test_pickle_task_lists_the_modules_loaded_from_a_path(probe: ModuleType) -> None:
    """Functions and classes of such a module are listed with its file; others are not."""
    task = (probe.function, operator.add, _pool.RankPool, probe.Payload(3))
    data, modules = pickle_task(task)
    assert modules == {probe.__name__: probe.__file__}
    assert pickle.loads(data) == task


def test_load_source_modules_loads_under_the_given_name(
    tmp_path: Path, module_names: list[str]
) -> None:
    """A source file is executed under the given dotted name, with empty parent packages."""
    path = tmp_path / "probe.py"
    path.write_text("VALUE = 1\n\n\ndef function() -> int:\n    return VALUE\n")
    name = "shard_testing_probe_a.tests.probe"
    module_names.append(name)
    load_source_modules({name: str(path)})
    module = sys.modules[name]
    assert module.VALUE == 1
    assert module.__file__ == str(path)
    assert sys.modules["shard_testing_probe_a.tests"].__path__ == []
    assert pickle.loads(pickle.dumps(module.function)) is module.function


def test_load_source_modules_caches_per_path_and_mtime(
    tmp_path: Path, module_names: list[str]
) -> None:
    """Loading again reuses the module until the file's mtime changes; then it is re-executed."""
    path = tmp_path / "probe.py"
    path.write_text("VALUE = 1\n")
    name = "shard_testing_probe_b"
    module_names.append(name)
    load_source_modules({name: str(path)})
    first = sys.modules[name]
    load_source_modules({name: str(path)})
    assert sys.modules[name] is first
    path.write_text("VALUE = 2\n")
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    load_source_modules({name: str(path)})
    assert sys.modules[name] is not first
    assert sys.modules[name].VALUE == 2


def test_load_source_modules_refuses_a_name_taken_by_another_module(tmp_path: Path) -> None:
    """A name another module already holds is refused, naming the file and the module."""
    path = tmp_path / "json.py"
    path.write_text("VALUE = 1\n")
    import json

    with pytest.raises(
        ImportError,
        match=rf"^cannot load {re.escape(str(path))} as module 'json' on the ranks: a different "
        rf"module \({re.escape(str(json.__file__))}\) already has that name; rename the test file$",
    ):
        load_source_modules({"json": str(path)})
    assert sys.modules["json"] is json


def test_load_source_modules_forgets_a_module_that_raises(
    tmp_path: Path, module_names: list[str]
) -> None:
    """A source file that raises while executing leaves no module behind."""
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('broken on import')\n")
    name = "shard_testing_probe_c"
    module_names.append(name)
    with pytest.raises(RuntimeError, match=r"^broken on import$"):
        load_source_modules({name: str(path)})
    assert name not in sys.modules
