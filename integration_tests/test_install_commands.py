"""README's install commands work as printed, from a checkout and from a git URL.

Each command runs in a fresh virtual environment that has nothing of shard: it
sees torch, numpy and the other third-party distributions of the development
environment through a folder of links, and installs with ``--no-index`` and
without build isolation, so no test needs the network. ``--dry-run --report``
makes pip resolve exactly what it would install, which is what can go wrong:
every shard distribution a command needs must come from the same checkout (a
``file://`` URL) or the same commit (a ``git+`` URL). One command, the whole
stack from the checkout, installs for real, and the installed ``shard``
command runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import venv
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from ._workspace import DISTRIBUTIONS, ROOT, declared_requirements

README = (ROOT / "README.md").read_text(encoding="utf-8")

CHECKOUT_CLOSURES = {
    "./packages/shard-runtime": {"shard-core", "shard-comms", "shard-runtime", "shard-device-cuda"},
    "./packages/shard-checkpoint": {
        "shard-core",
        "shard-comms",
        "shard-runtime",
        "shard-device-cuda",
        "shard-checkpoint",
    },
    "./packages/shard-cli": {
        "shard-core",
        "shard-comms",
        "shard-runtime",
        "shard-device-cuda",
        "shard-checkpoint",
        "shard-cli",
    },
    ".": {Path(d).name for d in DISTRIBUTIONS} | {"shard-stack"},
}
"""What each of README's checkout commands installs of shard, by its path argument."""


def _install_block(kind: str) -> list[str]:
    """The ``pip install`` lines of README's block of ``kind`` (checkout or git)."""
    section = README[README.index("## Packages") :]
    blocks = re.findall(r"```bash[^\n]*\n(.*?)```", section, flags=re.DOTALL)
    for block in blocks:
        lines = [line.split("  #")[0].strip() for line in block.splitlines()]
        installs = [line for line in lines if line.startswith("pip install")]
        if installs and (("$SHARD_GIT" in block) == (kind == "git")):
            return installs
    raise AssertionError(f"README's Packages section has no {kind} install block")


_BUILDERS = ["hatchling", "pip"]
"""What the fresh environment builds and installs with, beside what the distributions require."""


def _closure(names: list[str]) -> set[str]:
    """``names`` and every distribution they require here, transitively (markers applied)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional requirement this environment does not have
        seen.add(name)
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def _link_distributions(names: set[str], into: Path) -> None:
    """Link the top-level files of the installed distributions ``names`` into ``into``."""
    into.mkdir()
    for name in names:
        dist = metadata.distribution(name)
        base = Path(str(dist.locate_file("")))
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if ".." not in str(f)}:
            target = into / top
            if not target.exists() and (base / top).exists():
                target.symlink_to(base / top)


@pytest.fixture(scope="module")
def fresh_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtual environment without shard, seeing only third-party distributions."""
    root = tmp_path_factory.mktemp("fresh-venv")
    venv.create(root / "venv", with_pip=False)
    python = root / "venv" / "bin" / "python"
    declared = [
        Requirement(text).name
        for directory in [ROOT, *(ROOT / d for d in DISTRIBUTIONS)]
        for text in declared_requirements(directory)
    ]
    third_party = _closure([n for n in declared if not n.startswith("shard-")] + _BUILDERS)
    assert not {n for n in third_party if n.startswith("shard-")}, "shard leaked into the base"
    _link_distributions(third_party, root / "base")
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(purelib) / "shard_test_base.pth").write_text(f"{root / 'base'}\n", encoding="utf-8")
    return python


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "SHARD_"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _pip(python: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-m", "pip", *args, "--no-index", "--no-build-isolation", "-q"],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _resolve(python: Path, command: str, cwd: Path, tmp_path: Path) -> dict[str, str]:
    """What ``command`` (a README line) would install of shard: name -> where from.

    A ``file://`` URL for a directory; ``URL@COMMIT`` for a git requirement.
    """
    report = tmp_path / "report.json"
    argv = command.split()[2:]  # after "pip install"
    argv = [arg.strip("\"'") for arg in _rejoin(argv)]
    done = _pip(python, ["install", "--dry-run", "--report", str(report), *argv], cwd)
    assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    installs: list[dict[str, Any]] = json.loads(report.read_text(encoding="utf-8"))["install"]
    resolved = {}
    for item in installs:
        if item["metadata"]["name"].startswith("shard-"):
            info = item["download_info"]
            commit = info.get("vcs_info", {}).get("commit_id")
            where = info["url"] if commit is None else f"git+{info['url']}@{commit}"
            resolved[canonicalize_name(item["metadata"]["name"])] = where
    return resolved


def _rejoin(argv: list[str]) -> Iterator[str]:
    """Undo the split of a quoted argument (``"shard-cli @ git+URL"``)."""
    quoted: list[str] = []
    for arg in argv:
        if quoted or arg.startswith('"'):
            quoted.append(arg)
            if arg.endswith('"') and (len(quoted) > 1 or len(arg) > 1):
                yield " ".join(quoted)
                quoted = []
        else:
            yield arg


@pytest.mark.parametrize("command", [c for c in _install_block("checkout") if c != "pip install ."])
def test_checkout_command_installs_its_closure_from_the_checkout(
    command: str, fresh_python: Path, tmp_path: Path
) -> None:
    """Each checkout command resolves, offline, to its shard closure, all from this checkout."""
    path = command.split()[-1]
    resolved = _resolve(fresh_python, command, ROOT, tmp_path)
    assert set(resolved) == CHECKOUT_CLOSURES[path]
    for name, url in resolved.items():
        assert url.startswith(ROOT.as_uri()), f"{name} from {url}, not from the checkout"


def _package_readme_installs() -> list[str]:
    """The ``pip install ./…`` lines of the packages' and plugins' own READMEs."""
    lines = []
    for readme in sorted(ROOT.glob("*/*/README.md")):
        text = readme.read_text(encoding="utf-8")
        for block in re.findall(r"```bash[^\n]*\n(.*?)```", text, re.S):
            lines += [
                line.split("  #")[0].strip()
                for line in block.splitlines()
                if line.startswith("pip install ./")
            ]
    return lines


def test_package_readme_commands_install_from_the_checkout(
    fresh_python: Path, tmp_path: Path
) -> None:
    """Every package README's install line resolves, with shard-core, from the checkout."""
    commands = _package_readme_installs()
    paths = [command.split()[-1] for command in commands]
    assert len(paths) == len([d for d in DISTRIBUTIONS if d.startswith("plugins/")])  # each plugin
    resolved = _resolve(fresh_python, "pip install " + " ".join(paths), ROOT, tmp_path)
    assert set(resolved) == {Path(path).name for path in paths} | {"shard-core"}
    assert all(url.startswith(ROOT.as_uri()) for url in resolved.values()), resolved


@pytest.fixture(scope="module")
def git_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A git URL of this working tree, committed in a clone so that the test reads no remote."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout")
    clone = tmp_path_factory.mktemp("git") / "shard"

    def git(*args: str, cwd: Path = clone) -> str:
        done = subprocess.run(
            ["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True
        )
        return done.stdout

    git("clone", "-q", str(ROOT), str(clone), cwd=ROOT)
    git("rm", "-rq", ".")
    for name in git("ls-files", "-co", "--exclude-standard", "-z", cwd=ROOT).split("\0"):
        if name and (ROOT / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
    git("add", "-A")
    git(
        "-c",
        "user.name=test",
        "-c",
        "user.email=test@localhost",
        "commit",
        "--allow-empty",
        "-qm",
        "tree",
    )
    return f"git+file://localhost{clone}@{git('rev-parse', 'HEAD').strip()}"


def test_git_commands_install_their_closure_from_the_same_commit(
    fresh_python: Path, git_url: str, tmp_path: Path
) -> None:
    """README's git URL commands resolve every shard distribution to the commit named."""
    commands = _install_block("git")
    assert len(commands) == 4
    # The whole stack clones once per distribution; the CLI's closure covers the rest.
    for command in (commands[0], commands[-1]):
        expanded = command.replace("$SHARD_GIT", git_url)
        resolved = _resolve(fresh_python, expanded, tmp_path, tmp_path)
        target = re.search(r"subdirectory=(\S+?)[\"']?$", expanded)
        key = "." if target is None else "./" + target.group(1)
        assert set(resolved) == CHECKOUT_CLOSURES[key], command
        assert set(resolved.values()) == {git_url}, command


def test_whole_stack_installs_and_the_shard_command_runs(
    fresh_python: Path, tmp_path: Path
) -> None:
    """README's ``pip install .`` installs every distribution; the new ``shard`` command runs."""
    assert "pip install ." in _install_block("checkout")
    done = _pip(fresh_python, ["install", "."], ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    listed = subprocess.run(
        [str(fresh_python), "-m", "pip", "list", "--format", "json"],
        env=_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    installed = {canonicalize_name(d["name"]) for d in json.loads(listed.stdout)}
    assert {name for name in installed if name.startswith("shard-")} == CHECKOUT_CLOSURES["."]
    shard = fresh_python.parent / "shard"
    planned = subprocess.run(
        [str(shard), "plan", "--preset", "small", "--world-size", "8"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert planned.returncode == 0, planned.stderr
    assert "world size 8" in planned.stdout


def test_a_missing_sibling_is_named_with_the_fix(fresh_python: Path, tmp_path: Path) -> None:
    """A repository that lacks a sibling fails to build, naming it and the commands that work."""
    repository = tmp_path / "partial"
    for part in ("tools/packaging", "packages/shard-core", "packages/shard-runtime"):
        shutil.copytree(ROOT / part, repository / part, ignore=shutil.ignore_patterns("tests"))
    (repository / "plugins").mkdir()
    done = _pip(fresh_python, ["install", "--dry-run", "./packages/shard-runtime"], repository)
    assert done.returncode != 0
    assert (
        "shard-runtime needs shard-comms, shard-device-cuda from the same shard source"
        in done.stderr
    ), done.stderr
    assert "pip install ./packages/shard-cli" in done.stderr
