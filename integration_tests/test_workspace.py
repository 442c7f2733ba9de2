"""The shape of the monorepo: top level, self-contained distributions, layering, CI entry points.

These are the rules a newcomer relies on (DESIGN.md, section 1) and that a
new package most easily breaks: a missing ``py.typed``, a version written
twice, a dependency on a file URL, an import of a higher layer, a package the
shared mypy and ruff configuration does not know.
"""

from __future__ import annotations

import ast
import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from ._workspace import DISTRIBUTIONS, ROOT, SIBLINGS_HOOK, declared_requirements

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - CI runs 3.11
    tomllib = pytest.importorskip("tomli")

README_MAX_LINES = 60  # "a one-screen README.md"

# Each package may depend on the layers below it (DESIGN.md, section 1), transitively.
LAYER_DEPENDENCIES = {
    "shard-core": set(),
    "shard-comms": {"shard-core"},
    "shard-testing": {"shard-core"},
    "shard-runtime": {"shard-comms"},
    "shard-checkpoint": {"shard-runtime"},
    "shard-cli": {"shard-checkpoint"},
}


def _pyproject(path: Path) -> dict[str, Any]:
    with path.open("rb") as file:
        data: dict[str, Any] = tomllib.load(file)
    return data


def _project(distribution: str) -> dict[str, Any]:
    project: dict[str, Any] = _pyproject(ROOT / distribution / "pyproject.toml")["project"]
    return project


def _import_name(distribution: str) -> str:
    return Path(distribution).name.replace("-", "_")


def _own_dependencies(distribution: str) -> dict[str, Requirement]:
    requirements = (Requirement(text) for text in declared_requirements(ROOT / distribution))
    return {r.name: r for r in requirements if r.name.startswith("shard-")}


def _allowed(name: str) -> set[str]:
    """``name`` and every shard distribution it may import, following declared dependencies."""
    if name.startswith("shard-") and name not in LAYER_DEPENDENCIES:
        distribution = next(d for d in DISTRIBUTIONS if Path(d).name == name)
        direct = set(_own_dependencies(distribution))
    else:
        direct = LAYER_DEPENDENCIES[name]
    return {name}.union(*(_allowed(dep) for dep in direct))


def test_top_level_is_exactly_the_workspace() -> None:
    """The repository holds packages, plugins, integration tests, tools, examples, config,
    README, ARCHITECTURE, DESIGN, LICENSE, CI."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    top = {name.split("/")[0] for name in listed} - {".gitignore"}
    assert top == {
        ".ci",
        ".github",
        "ARCHITECTURE.md",
        "DESIGN.md",
        "LICENSE",
        "README.md",
        "examples",
        "integration_tests",
        "packages",
        "plugins",
        "pyproject.toml",
        "tools",
    }
    assert (ROOT / ".ci" / "run").is_file()


def test_the_bundled_distributions_are_found() -> None:
    """The per-distribution checks of integration_tests see the six layers and every bundled
    plugin (so they cannot pass on none); a new distribution is found without a change here."""
    assert {f"packages/{name}" for name in LAYER_DEPENDENCIES} | {
        "plugins/shard-comm-lowp",
        "plugins/shard-comm-quant",
        "plugins/shard-device-accel",
        "plugins/shard-device-cuda",
        "plugins/shard-wrap-example",
        "plugins/shard-wrap-size",
        "plugins/shard-wrap-transformer",
    } <= set(DISTRIBUTIONS)


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_distribution_is_self_contained(distribution: str) -> None:
    """hatchling, src/<import name>/ with py.typed, tests/, a one-screen README, one version."""
    here = ROOT / distribution
    data = _pyproject(here / "pyproject.toml")
    project = data["project"]
    name = _import_name(distribution)
    assert project["name"] == Path(distribution).name
    assert data["build-system"]["build-backend"] == "hatchling.build"
    assert any(r.startswith("hatchling") for r in data["build-system"]["requires"])
    assert project["readme"] == "README.md"
    assert project["dynamic"] == ["version", "dependencies"]
    hook = data["tool"]["hatch"]["metadata"]["hooks"]["custom"]
    assert (here / hook["path"]).resolve() == ROOT / SIBLINGS_HOOK
    assert data["tool"]["hatch"]["metadata"]["allow-direct-references"] is True
    assert data["tool"]["hatch"]["version"]["path"] == f"src/{name}/_version.py"
    assert data["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == [f"src/{name}"]
    assert (here / "src" / name / "__init__.py").is_file()
    assert (here / "src" / name / "py.typed").is_file()
    assert list((here / "tests").glob("test_*.py")) != []
    readme = (here / "README.md").read_text(encoding="utf-8").splitlines()
    assert readme[0] == f"# {Path(distribution).name}"
    assert len(readme) <= README_MAX_LINES, f"{distribution}/README.md has {len(readme)} lines"
    versions = [
        path.relative_to(here).as_posix()
        for path in (here / "src").rglob("*.py")
        if re.search(r"^__version__\s*=", path.read_text(encoding="utf-8"), re.MULTILINE)
    ]
    assert versions == [f"src/{name}/_version.py"]
    module = importlib.import_module(name)
    assert Version(module.__version__) >= Version("0.1.0")


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_dependencies_on_our_packages_are_version_ranges(distribution: str) -> None:
    """A declared dependency on another shard distribution is a version range it satisfies,
    never a URL (the siblings hook adds the URL when it builds)."""
    for dep_name, requirement in _own_dependencies(distribution).items():
        assert requirement.url is None, f"{distribution} depends on {requirement} by URL"
        assert str(requirement.specifier) != "", f"{distribution}: {requirement} has no range"
        target = next(d for d in DISTRIBUTIONS if Path(d).name == dep_name)
        version = importlib.import_module(_import_name(target)).__version__
        assert requirement.specifier.contains(version), (distribution, str(requirement), version)


def _dev_torch_pin() -> Version:
    """The one torch version the development environment (and so CI) installs and tests."""
    dev = _pyproject(ROOT / "pyproject.toml")["tool"]["hatch"]["envs"]["dev"]
    pins = [Requirement(text) for text in dev["dependencies"]]
    (torch,) = [r for r in pins if r.name == "torch"]
    (spec,) = torch.specifier
    assert spec.operator == "==", f"the dev environment must pin torch exactly, not {torch}"
    return Version(spec.version)


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_torch_lower_bound_is_the_tested_version(distribution: str) -> None:
    """Each distribution declares torch >= the version CI tests (no untested older torch), < 3."""
    requirements = [Requirement(text) for text in declared_requirements(ROOT / distribution)]
    (torch,) = [r for r in requirements if r.name == "torch"]
    lower = [Version(s.version) for s in torch.specifier if s.operator == ">="]
    upper = [Version(s.version) for s in torch.specifier if s.operator == "<"]
    pin = _dev_torch_pin()
    assert lower == [Version(f"{pin.major}.{pin.minor}")], (distribution, str(torch), str(pin))
    assert upper == [Version("3")], (distribution, str(torch))


def test_every_src_package_is_typed() -> None:
    """Every importable package under packages/*/src and plugins/*/src ships a py.typed."""
    roots = [
        package
        for group in ("packages", "plugins")
        for package in (ROOT / group).glob("*/src/*")
        if (package / "__init__.py").is_file()
    ]
    assert len(roots) == len(DISTRIBUTIONS)
    assert [p.relative_to(ROOT).as_posix() for p in roots if not (p / "py.typed").is_file()] == []


def test_the_whole_stack_requires_every_distribution() -> None:
    """The root's shard-stack (``pip install .``) requires each distribution once, by range, and
    offers shard-cli's extras under the same names."""
    root = _pyproject(ROOT / "pyproject.toml")
    assert root["project"]["name"] == "shard-stack"
    assert (ROOT / root["tool"]["hatch"]["metadata"]["hooks"]["custom"]["path"]) == (
        ROOT / SIBLINGS_HOOK
    )
    required = [Requirement(text) for text in declared_requirements(ROOT)]
    assert sorted(r.name for r in required) == sorted(Path(d).name for d in DISTRIBUTIONS)
    assert all(str(r.specifier) for r in required)
    cli = _project("packages/shard-cli")
    assert root["project"]["optional-dependencies"] == cli["optional-dependencies"]


def test_shard_runtime_brings_the_cuda_device_plugin() -> None:
    """Installing shard-runtime on a GPU machine brings shard-device-cuda (no silent CPU run)."""
    assert "shard-device-cuda" in _own_dependencies("packages/shard-runtime")


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_source_imports_only_lower_layers(distribution: str) -> None:
    """src/ imports shard packages it depends on (transitively) only; plugins need shard-core."""
    name = Path(distribution).name
    allowed = {n.replace("-", "_") for n in _allowed(name)}
    if distribution.startswith("plugins/"):
        assert set(_own_dependencies(distribution)) == {"shard-core"}
    seen: set[str] = set()
    for path in (ROOT / distribution / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                seen.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                seen.add(node.module.split(".")[0])
    assert {m for m in seen if m.startswith("shard_")} - allowed == set()


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_public_surface_is_a_sorted_all_of_existing_names(distribution: str) -> None:
    """Each package's __all__ is sorted, without duplicates, and every name exists."""
    module = importlib.import_module(_import_name(distribution))
    names = list(module.__all__)
    assert names == sorted(set(names))
    assert [n for n in names if not hasattr(module, n)] == []


def test_shared_configuration_knows_every_distribution() -> None:
    """mypy (strict) checks every src/, ruff knows every import name, hatch installs them all."""
    tool = _pyproject(ROOT / "pyproject.toml")["tool"]
    assert tool["mypy"]["strict"] is True
    assert set(tool["mypy"]["files"]) == {"packages/*/src", "plugins/*/src"}
    assert {f"{d}/src" for d in DISTRIBUTIONS} <= set(tool["mypy"]["mypy_path"])
    first_party = set(tool["ruff"]["lint"]["isort"]["known-first-party"])
    assert {_import_name(d) for d in DISTRIBUTIONS} <= first_party
    assert tool["hatch"]["envs"]["dev"]["workspace"]["members"] == ["packages/*", "plugins/*"]
    assert tool["pytest"]["ini_options"]["testpaths"] == [
        "packages",
        "plugins",
        "integration_tests",
    ]


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run runs README's second command; the CPU job runs .ci/run, the GPU job check.sh."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash[^\n]*\n(.*?)\n```", quick_start, re.DOTALL)
    assert len(commands) == 2
    assert commands[1] in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    cpu = (ROOT / ".github" / "workflows" / "cpu.yml").read_text(encoding="utf-8")
    assert "run: bash .ci/run" in cpu
    gpu = (ROOT / ".github" / "workflows" / "gpu.yml").read_text(encoding="utf-8")
    assert "runs-on: [self-hosted, gpu]" in gpu
    assert re.search(r"run: bash tools/gpu/check.sh$", gpu, re.MULTILINE)
