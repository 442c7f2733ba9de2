"""Every distribution declares what its source imports, and imports the shard packages it declares.

In the workspace every package is installed, so an import of a package that
is not declared works here and fails for a user who installs the one
distribution (``pip install ./packages/shard-cli`` without shard-runtime's
own dependencies, say, once shard-checkpoint stops pulling it in). These
tests read each ``src/`` tree's import statements (``ast``) and compare them
with ``[project] dependencies`` and ``[project.optional-dependencies]``:

- a ``shard_*`` import anywhere, or a third-party import at module level, is
  a ``dependencies`` entry;
- a third-party import inside a function or guarded by ``except
  ImportError`` (an optional feature) is in ``dependencies`` or an extra;
- imports under ``if TYPE_CHECKING:`` need nothing at run time;
- a declared ``shard-*`` dependency is imported, unless it is a plugin
  (entry-point group ``shard``), which is brought for its entry point and
  never imported (shard-runtime brings shard-device-cuda).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from ._workspace import DISTRIBUTIONS, ROOT, declared_requirements

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - CI runs 3.11
    tomllib = pytest.importorskip("tomli")


# Import name -> distribution, for the third-party modules our sources import.
# A module missing here fails test_every_third_party_import_is_mapped: add it.
MODULE_DISTRIBUTIONS = {
    "crc32c": "crc32c",
    "matplotlib": "matplotlib",
    "numpy": "numpy",
    "packaging": "packaging",
    "peft": "peft",
    "pluggy": "pluggy",
    "pytest": "pytest",
    "_pytest": "pytest",
    "hypothesis": "hypothesis",
    "safetensors": "safetensors",
    "tomli": "tomli",
    "torch": "torch",
    "transformers": "transformers",
}
# Submodules of a mapped package that need another distribution as well.
SUBMODULE_DISTRIBUTIONS = {"torch.utils.tensorboard": "tensorboard"}


@dataclass(frozen=True)
class Import:
    """One imported module, where it is imported, and whether it must be there at import time."""

    module: str
    path: Path
    line: int
    required: bool  # module level and unguarded: the distribution cannot do without it


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(
        isinstance(k, ast.Name) and k.id in {"ImportError", "ModuleNotFoundError"} for k in kinds
    )


def _imports(path: Path) -> list[Import]:
    found: list[Import] = []

    def visit(node: ast.AST, *, required: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, required=required)
            return  # typing only
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(alias.name, path, node.lineno, required))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(Import(node.module, path, node.lineno, required))
        lazy = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        guarded = isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers)
        for child in ast.iter_child_nodes(node):
            visit(child, required=required and not lazy and not guarded)

    visit(ast.parse(path.read_text(encoding="utf-8")), required=True)
    return found


def _project(distribution: str) -> dict[str, Any]:
    with (ROOT / distribution / "pyproject.toml").open("rb") as file:
        project: dict[str, Any] = tomllib.load(file)["project"]
    return project


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(text).name) for text in requirements}


def _declared(distribution: str) -> tuple[set[str], set[str]]:
    """(``dependencies``, every extra's requirements together), as canonical names."""
    project = _project(distribution)
    extras = project.get("optional-dependencies", {})
    return _names(declared_requirements(ROOT / distribution)), _names(
        [text for texts in extras.values() for text in texts]
    )


def _distributions_of(module: str) -> list[str]:
    """The distributions ``module`` needs; ``[]`` for the standard library; KeyError if unknown."""
    top = module.split(".")[0]
    if top in sys.stdlib_module_names:
        return []
    if top.startswith("shard_"):
        return [canonicalize_name(top.replace("_", "-"))]
    needed = [MODULE_DISTRIBUTIONS[top]]
    needed += [d for prefix, d in SUBMODULE_DISTRIBUTIONS.items() if module.startswith(prefix)]
    return needed


def _source_imports(distribution: str) -> list[Import]:
    own = Path(distribution).name.replace("-", "_")
    return [
        found
        for path in sorted((ROOT / distribution / "src").rglob("*.py"))
        for found in _imports(path)
        if found.module.split(".")[0] != own
    ]


def _is_plugin(name: str) -> bool:
    """Whether the workspace distribution ``name`` registers under the entry-point group shard."""
    for distribution in DISTRIBUTIONS:
        if canonicalize_name(Path(distribution).name) == name:
            return "shard" in _project(distribution).get("entry-points", {})
    return False


def _where(found: Import) -> str:
    return f"{found.path.relative_to(ROOT)}:{found.line} imports {found.module}"


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_every_third_party_import_is_mapped(distribution: str) -> None:
    """Every module src/ imports is stdlib, a shard package, or in MODULE_DISTRIBUTIONS."""
    unknown = []
    for found in _source_imports(distribution):
        try:
            _distributions_of(found.module)
        except KeyError:
            unknown.append(_where(found))
    assert unknown == [], "map these modules to their distributions in MODULE_DISTRIBUTIONS"


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_every_import_is_declared(distribution: str) -> None:
    """shard_* and module-level imports are dependencies; lazy third-party ones at least extras."""
    dependencies, extras = _declared(distribution)
    missing: dict[str, str] = {}  # distribution to declare -> the first import needing it
    for found in _source_imports(distribution):
        try:
            needed = _distributions_of(found.module)
        except KeyError:
            continue  # test_every_third_party_import_is_mapped names it
        must_be_dependency = found.required or found.module.startswith("shard_")
        allowed = dependencies if must_be_dependency else dependencies | extras
        for name in needed:
            if name not in allowed:
                missing.setdefault(name, _where(found))
    assert missing == {}, "declare these in [project] dependencies (or an extra, if lazy)"


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_declared_shard_dependencies_are_imported(distribution: str) -> None:
    """A declared shard-* dependency is imported somewhere in src/, or is a plugin brought along."""
    dependencies, _ = _declared(distribution)
    imported = {
        d
        for found in _source_imports(distribution)
        if found.module.startswith("shard_")
        for d in _distributions_of(found.module)
    }
    unused = {
        d
        for d in dependencies
        if d.startswith("shard-") and d not in imported and not _is_plugin(d)
    }
    assert unused == set()


def test_the_reader_sees_guarded_lazy_and_typing_only_imports(tmp_path: Path) -> None:
    """Module-level imports are required; function-level and ImportError-guarded are not."""
    source = tmp_path / "m.py"
    source.write_text(
        "import torch\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    import matplotlib\n"
        "try:\n"
        "    import numpy\n"
        "except ImportError:\n"
        "    numpy = None\n"
        "def f():\n"
        "    from transformers import AutoModel\n",
        encoding="utf-8",
    )
    got = {(i.module, i.required) for i in _imports(source)}
    assert got == {("torch", True), ("typing", True), ("numpy", False), ("transformers", False)}
    assert _distributions_of("torch.utils.tensorboard") == ["torch", "tensorboard"]
