"""The workspace the integration tests check: the repository root and its distributions."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - CI runs 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]

DISTRIBUTIONS = sorted(
    path.parent.relative_to(ROOT).as_posix()
    for group in ("packages", "plugins")
    for path in (ROOT / group).glob("*/pyproject.toml")
)
"""Every distribution, as ``packages/<name>`` or ``plugins/<name>``: each directory of
``packages/`` and ``plugins/`` holding a ``pyproject.toml``, sorted."""

SIBLINGS_HOOK = "tools/packaging/siblings.py"
"""The hatchling hook that turns declared shard requirements into references to their source."""


def pyproject(path: Path) -> dict[str, Any]:
    """The parsed ``pyproject.toml`` at ``path``."""
    with path.open("rb") as file:
        data: dict[str, Any] = tomllib.load(file)
    return data


def declared_requirements(directory: Path) -> list[str]:
    """The requirements the distribution at ``directory`` declares, as written.

    They live in the siblings hook's table (``[tool.hatch.metadata.hooks.custom]
    dependencies``), ``dependencies`` being dynamic in ``[project]``; the hook
    publishes them with shard ones pointed at their source.
    """
    hook: dict[str, Any] = pyproject(directory / "pyproject.toml")["tool"]["hatch"]["metadata"][
        "hooks"
    ]["custom"]
    requirements: list[str] = hook["dependencies"]
    return requirements
