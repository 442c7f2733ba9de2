"""No two product modules import each other, directly or around a loop.

A circle of imports is what made ``_wrapper.py`` and ``_flat_units.py`` (and
``_train.py`` and ``_report.py``) hard to change: neither can be read, moved
or tested without the other, and the loop is usually broken by an import
hidden inside a function, which only moves the problem. This test reads every
module under ``packages/*/src`` and ``plugins/*/src`` (``ast``), takes each
import of a shard module, at module level or inside a function (not under
``if TYPE_CHECKING:``, which costs nothing at run time), and looks for
strongly connected groups of modules.

``from package import submodule`` counts as an import of the submodule, not
of the package's ``__init__``. One loop is known and allowed (``ALLOWED``).
"""

from __future__ import annotations

import ast
from pathlib import Path

from ._workspace import DISTRIBUTIONS, ROOT

ALLOWED = {
    # use_shard_for_torch_fsdp pairs PyTorch's names with shard_runtime.__all__ and
    # shard_runtime.wrap.__all__ when it is called: it needs the finished package, whose
    # __init__ exports it.
    frozenset(
        {"shard_runtime", "shard_runtime.integrations", "shard_runtime.integrations.torch_fsdp"}
    ),
}


def _modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for dist in DISTRIBUTIONS:
        src = ROOT / dist / "src"
        for path in src.rglob("*.py"):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The shard modules ``path`` imports, anywhere but under ``if TYPE_CHECKING:``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names}
            found.update(submodules & modules.keys())
            if not submodules <= modules.keys():
                found.add(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return found & modules.keys()


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected groups of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(frozenset(group))
    return groups


def test_the_cycle_finder_finds_a_loop() -> None:
    """A three-module loop is found; the module hanging off it is not part of it."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [frozenset({"a", "b", "c"})]


def test_product_modules_import_no_circle() -> None:
    """Every loop of imports among product modules is one ALLOWED names."""
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    loops = [sorted(group) for group in _cycles(graph) if group not in ALLOWED]
    assert loops == [], "import circles (module -> the members it imports):\n" + "\n".join(
        f"  {member} -> {sorted(graph[member] & set(group))}" for group in loops for member in group
    )
