"""Hatchling metadata hook: shard distributions depend on their siblings from the same source.

Every distribution of this repository declares its requirements under
``[tool.hatch.metadata.hooks.custom] dependencies`` (``dependencies`` is dynamic in
``[project]``), the shard ones as ordinary ranges (``"shard-core>=0.1.0,<0.2"``).
The shard names on PyPI belong to unrelated projects, so an ordinary range can only be
met by a sibling that is installed already; ``pip install ./packages/shard-runtime``
alone used to fail with pip's "Could not find a version that satisfies the requirement
shard-comms". This hook turns each sibling requirement into a reference to the same
source the distribution is built from, so that one command installs a distribution
and everything below it:

* built from a checkout (``pip install ./packages/shard-cli``, or ``pip install .``
  for the whole stack): ``shard-core @ file:///…/packages/shard-core``;
* built from a git URL (``pip install "shard-cli @ git+URL@REV#subdirectory=…"``,
  which pip clones into a temporary ``pip-*`` directory): the same commit,
  ``shard-core @ git+URL@SHA#subdirectory=packages/shard-core``, never the temporary
  directory, which is gone when pip later reuses a wheel it cached for that commit;
* ``SHARD_SIBLINGS=ranges`` in the environment keeps the ranges as written: the
  development workspace (hatch installs every member editable itself, and pip refuses
  an editable member beside a ``file://`` requirement on it), and wheels built to be
  installed together from one folder (``pip install --no-index --find-links wheels``).

A distribution copied out of the repository without its siblings cannot be built:
the error names the missing distributions and the commands that work.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from hatchling.metadata.plugin.interface import MetadataHookInterface
from packaging.requirements import Requirement

ENV_MODE = "SHARD_SIBLINGS"
"""``ranges`` keeps sibling requirements as declared; unset (or ``source``) points them at the
source the distribution is built from."""

_GROUPS = ("packages", "plugins")
"""The folders of the repository that hold distributions, one directory each."""


# [Note: pip's wheel cache and sibling directories]
# pip keeps the wheel it builds for a ``file://`` requirement in its persistent cache, keyed
# by the URL, when the URL's last part looks like ``name-version`` - which every directory
# here does (``shard-core``). A later install from an edited checkout would then reuse the
# stale wheel. The URL therefore ends in ``/.``: the same directory, a last part that is not
# ``name-version``, and pip builds it afresh each time, as it does for ``pip install ./dir``.


def _sibling_name(requirement: str) -> str | None:
    """The shard distribution ``requirement`` names, or ``None`` for a third-party one."""
    name = Requirement(requirement).name.lower()
    return name if name.startswith("shard-") else None


def _repository(root: Path) -> Path:
    """The checkout ``root`` belongs to: itself (the whole-stack distribution) or two up."""
    return root if all((root / group).is_dir() for group in _GROUPS) else root.parent.parent


def _pointed(requirement: str, url: str) -> str:
    """``requirement`` with its version range replaced by ``url``; extras and markers kept."""
    parsed = Requirement(requirement)
    extras = f"[{','.join(sorted(parsed.extras))}]" if parsed.extras else ""
    marker = f" ; {parsed.marker}" if parsed.marker else ""
    return f"{parsed.name}{extras} @ {url}{marker}"


def _git(repository: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repository), *args], check=True, capture_output=True, text=True
    ).stdout.strip()


def _pip_vcs_clone(repository: Path) -> tuple[str, str] | None:
    """``(url, commit)`` when ``repository`` is pip's temporary clone of a git URL.

    pip clones a git requirement under the temporary directory, in a folder of its own
    named ``pip-…`` (``pip-install-*/<name>_<hash>`` or ``pip-req-build-*``).
    """
    temporary = Path(tempfile.gettempdir()).resolve()
    if not (repository / ".git").exists() or not repository.is_relative_to(temporary):
        return None
    if not any(part.startswith("pip-") for part in repository.relative_to(temporary).parts):
        return None
    url = _git(repository, "remote", "get-url", "origin")
    if url.startswith("file:///"):
        # A requirement's URL needs a host: pip's older packaging refuses git+file:///path.
        url = "file://localhost/" + url[len("file:///") :]
    return url, _git(repository, "rev-parse", "HEAD")


class SiblingsHook(MetadataHookInterface):
    """Sets ``dependencies`` from the hook's list, siblings pointed at their source."""

    PLUGIN_NAME = "custom"

    def update(self, metadata: dict[str, Any]) -> None:
        declared: list[str] = list(self.config.get("dependencies", []))
        mode = os.environ.get(ENV_MODE, "source")
        if mode not in ("source", "ranges"):
            raise ValueError(f"{ENV_MODE}={mode!r}: expected 'source' (the default) or 'ranges'")
        if mode == "ranges":
            metadata["dependencies"] = declared
            return
        root = Path(self.root).resolve()
        repository = _repository(root)
        siblings = {
            path.name: path
            for group in _GROUPS
            for path in (repository / group).glob("*")
            if (path / "pyproject.toml").is_file()
        }
        wanted = [name for name in map(_sibling_name, declared) if name is not None]
        missing = sorted(name for name in wanted if name not in siblings)
        if missing:
            raise RuntimeError(
                f"{metadata['name']} needs {', '.join(missing)} from the same shard source, "
                f"and {repository} does not hold them (was {root.name} copied out of the "
                "repository?). Install from a checkout (pip install ./packages/shard-cli, "
                "or pip install . for everything) or from a git URL "
                '(pip install "shard-cli @ git+URL#subdirectory=packages/shard-cli"); '
                f"to build wheels that name their siblings by version, set {ENV_MODE}=ranges. "
                "Never install shard distributions from PyPI: the names there belong to "
                "unrelated projects."
            )
        clone = _pip_vcs_clone(repository)
        resolved = []
        for requirement in declared:
            name = _sibling_name(requirement)
            if name is None:
                resolved.append(requirement)
                continue
            location = siblings[name]
            if clone is not None:
                url, commit = clone
                subdirectory = location.relative_to(repository).as_posix()
                resolved.append(
                    _pointed(requirement, f"git+{url}@{commit}#subdirectory={subdirectory}")
                )
            else:
                # See [Note: pip's wheel cache and sibling directories]
                resolved.append(_pointed(requirement, f"{location.as_uri()}/."))
        metadata["dependencies"] = resolved
