"""How a task's function and arguments reach the ranks.

[Note: Functions travel by reference]
With ``--import-mode=importlib`` pytest imports a test file under a name
that no other process can import (``packages.shard-testing.tests.test_x``,
with no package on ``sys.path`` behind it). Pickle sends functions and
classes by module name and qualified name, so the pool pickles the task
with a pickler that notes every module it references which a fresh process
could not import by name, together with that module's source file. The
worker loads those files first, with
``importlib.util.spec_from_file_location``, under the very name the test
process uses, cached per (path, mtime): then pickled references resolve in
both directions, for the function, for arguments of classes the test file
defines, and for results of such classes.

Modules a fresh process can import by name (``shard_testing``, ``operator``,
installed packages, the ``__main__`` script, which ``spawn`` re-imports) travel
by name as plain pickle would send them. Arguments and results travel as
bytes: a CPU tensor pickles by value, so no memory is ever shared with a
process that may die.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import io
import os
import pickle
import sys
import types
from collections.abc import Mapping
from typing import Any

__all__ = ["describe", "load_source_modules", "pickle_task", "source_file_if_not_importable"]

_MAIN_MODULES = frozenset({"__main__", "__mp_main__"})

# - test process: (module name, source file) -> whether a fresh process imports it by name
_IMPORTABLE: dict[tuple[str, str], bool] = {}
# - worker: (path, mtime in ns) -> the module loaded from it; names loaded that way
_LOADED: dict[tuple[str, int], types.ModuleType] = {}
_LOADED_NAMES: set[str] = set()


def describe(fn: object) -> str:
    """A function's qualified name with its module, for messages."""
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}.{name}" if module else name


def pickle_task(obj: object) -> tuple[bytes, dict[str, str]]:
    """Pickle ``obj`` and list the source files the ranks must load first.

    Returns the bytes and ``{module name: source path}`` for every module
    referenced by ``obj`` that a fresh process could not import by name.
    Raises whatever pickle raises for an object that cannot travel.
    """
    buffer = io.BytesIO()
    pickler = _RecordingPickler(buffer)
    pickler.dump(obj)
    return buffer.getvalue(), pickler.modules


class _RecordingPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.modules: dict[str, str] = {}

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type | types.FunctionType | types.BuiltinFunctionType):
            name = getattr(obj, "__module__", None)
            if isinstance(name, str) and name not in self.modules:
                path = source_file_if_not_importable(name)
                if path is not None:
                    self.modules[name] = path
        return NotImplemented


def source_file_if_not_importable(name: str) -> str | None:
    """The source file of module ``name`` when a fresh process could not import it by name.

    ``None`` when the module is importable by name (or is the ``__main__``
    script, or has no source file, or is not loaded: then plain pickle's
    by-name reference is all there is).
    """
    path = getattr(sys.modules.get(name), "__file__", None)
    if name in _MAIN_MODULES or not isinstance(path, str) or not path.endswith(".py"):
        return None
    key = (name, path)
    if key not in _IMPORTABLE:
        spec = _find_spec_on_sys_path(name)
        origin = None if spec is None else spec.origin
        _IMPORTABLE[key] = (
            origin is not None and os.path.exists(origin) and os.path.samefile(origin, path)
        )
    return None if _IMPORTABLE[key] else path


def _find_spec_on_sys_path(name: str) -> importlib.machinery.ModuleSpec | None:
    """The spec a fresh process would find for ``name``, ignoring ``sys.modules``."""
    search: list[str] | None = None
    spec = None
    parts = name.split(".")
    for index in range(len(parts)):
        if index:
            if spec is None or spec.submodule_search_locations is None:
                return None
            search = list(spec.submodule_search_locations)
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[: index + 1]), search)
        if spec is None:
            return None
    return spec


def load_source_modules(modules: Mapping[str, str]) -> None:
    """Load each ``{name: path}`` source file under ``name``, once per (path, mtime).

    Runs on the ranks before unpickling a task. Raises ``ImportError`` when
    ``name`` is already taken by a different module in this process.
    """
    for name, path in modules.items():
        _load_source_module(name, path)


def _load_source_module(name: str, path: str) -> types.ModuleType:
    key = (path, os.stat(path).st_mtime_ns)
    module = _LOADED.get(key)
    if module is None:
        current = sys.modules.get(name)
        if current is not None and name not in _LOADED_NAMES:
            raise ImportError(
                f"cannot load {path} as module {name!r} on the ranks: a different module "
                f"({getattr(current, '__file__', None) or repr(current)}) already has that name; "
                "rename the test file"
            )
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path} as module {name!r} on the ranks")
        module = importlib.util.module_from_spec(spec)
        _add_parent_packages(name)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        for stale in [k for k in _LOADED if k[0] == path]:
            del _LOADED[stale]
        _LOADED[key] = module
        _LOADED_NAMES.add(name)
    sys.modules[name] = module
    return module


def _add_parent_packages(name: str) -> None:
    """Put empty parent packages in ``sys.modules`` so that ``import a.b.c`` finds ``a.b.c``."""
    parts = name.split(".")
    for index in range(1, len(parts)):
        parent = ".".join(parts[:index])
        if parent not in sys.modules:
            package = types.ModuleType(parent)
            package.__path__ = []
            sys.modules[parent] = package
