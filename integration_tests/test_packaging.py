"""What every distribution ships besides its code: ``py.typed`` and the Apache-2.0 license.

A user who installs one package from this repository gets a wheel, not the
checkout: the license text and the typing marker must travel inside it.
Hatchling puts each distribution's own ``LICENSE`` (its default
``license-files`` glob, relative to the distribution's directory) under
``.dist-info/licenses/``; a file above the distribution's directory cannot be
shipped, so each distribution holds a copy of the top-level ``LICENSE``, and
this module keeps the copies identical.
"""

from __future__ import annotations

import email.parser
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from ._workspace import DISTRIBUTIONS, ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - CI runs 3.11
    tomllib = pytest.importorskip("tomli")


def _pyproject(distribution: str) -> dict[str, Any]:
    with (ROOT / distribution / "pyproject.toml").open("rb") as file:
        data: dict[str, Any] = tomllib.load(file)
    return data


def _import_name(distribution: str) -> str:
    packages: list[str] = _pyproject(distribution)["tool"]["hatch"]["build"]["targets"]["wheel"][
        "packages"
    ]
    assert len(packages) == 1, f"{distribution}: one package per distribution, got {packages}"
    return Path(packages[0]).name


def _hatchling() -> list[str] | None:
    """The command that runs hatchling here, or ``None``: building must not need the network."""
    if importlib.util.find_spec("hatchling") is not None:
        return [sys.executable, "-m", "hatchling"]
    found = shutil.which("hatchling")
    return [found] if found else None


def test_top_level_license_is_apache_2() -> None:
    """LICENSE at the top is the whole Apache License 2.0, terms through the appendix."""
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text.splitlines()[1]
    assert "Version 2.0, January 2004" in text
    for heading in (
        "1. Definitions.",
        "2. Grant of Copyright License.",
        "3. Grant of Patent License.",
        "4. Redistribution.",
        "9. Accepting Warranty or Additional Liability.",
        "END OF TERMS AND CONDITIONS",
        "APPENDIX: How to apply the Apache License to your work.",
    ):
        assert heading in text, heading


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_distribution_declares_and_holds_the_license(distribution: str) -> None:
    """pyproject says Apache-2.0, and the LICENSE hatchling ships is the top-level one."""
    project = _pyproject(distribution)["project"]
    assert project["license"] == "Apache-2.0"
    for pattern in project.get("license-files", ["LICENSE"]):
        assert list((ROOT / distribution).glob(pattern)), f"{distribution}: no {pattern}"
    copy = ROOT / distribution / "LICENSE"
    assert copy.read_bytes() == (ROOT / "LICENSE").read_bytes(), (
        f"{distribution}/LICENSE differs from the top-level LICENSE; copy it again"
    )


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_distribution_has_py_typed(distribution: str) -> None:
    """Every package and plugin marks itself typed (PEP 561), so users' mypy reads its hints."""
    marker = ROOT / distribution / "src" / _import_name(distribution) / "py.typed"
    assert marker.is_file(), f"{distribution}: add {marker.relative_to(ROOT)}"


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_wheel_ships_py_typed_and_license(distribution: str, tmp_path: Path) -> None:
    """The built wheel holds py.typed, the license file and the license metadata."""
    command = _hatchling()
    if command is None:
        pytest.skip("hatchling is not installed; building a wheel offline needs it")
    subprocess.run(
        [*command, "build", "--target", "wheel", "--directory", str(tmp_path)],
        cwd=ROOT / distribution,
        check=True,
        capture_output=True,
        timeout=120,
    )
    (wheel,) = tmp_path.glob("*.whl")
    name = _import_name(distribution)
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        dist_info = metadata_name.rsplit("/", 1)[0]
        assert f"{name}/py.typed" in names
        assert f"{dist_info}/licenses/LICENSE" in names
        shipped = archive.read(f"{dist_info}/licenses/LICENSE")
        metadata = email.parser.Parser().parsestr(archive.read(metadata_name).decode("utf-8"))
    assert shipped == (ROOT / "LICENSE").read_bytes()
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
