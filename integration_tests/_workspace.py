"""The workspace the integration tests check: the repository root and its distributions."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DISTRIBUTIONS = sorted(
    path.parent.relative_to(ROOT).as_posix()
    for group in ("packages", "plugins")
    for path in (ROOT / group).glob("*/pyproject.toml")
)
"""Every distribution, as ``packages/<name>`` or ``plugins/<name>``: each directory of
``packages/`` and ``plugins/`` holding a ``pyproject.toml``, sorted."""
