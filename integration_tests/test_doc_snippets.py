"""Every code block of README.md and the packages' READMEs runs as printed, or says why not.

A block's info string, after its language, says how it is checked:

- ``run``: Python run as printed, in a fresh namespace, by one process (a world of one,
  not under ``torchrun``) that runs every such block of every document in turn;
- ``run ranks=1,2``: Python run as printed on each rank of shard-testing's rank pool, at
  each world size listed (distributed code: ``init_distributed()`` adopts the pool's group);
- ``tested by PATH``: a test in ``PATH`` reads the document and runs the block;
- ``excerpt: why``: not run. Python excerpts must still compile, the ``shard`` command
  lines of any shell block must parse with shard's own argument parser, TOML must parse,
  and a ``[project.entry-points.shard]`` table must be the plugin's real one.

A block without one of these fails the first test, naming the file and line.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
from torch import nn

from shard_cli.__main__ import build_parser, train_parser
from shard_core import plan_wraps
from shard_core.plugin import Registry, make_plugin_manager
from shard_testing import RankPool

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - CI runs 3.11
    tomllib = pytest.importorskip("tomli")

# No import of ._workspace: the rank pool loads this file by path, outside the package.
ROOT = Path(__file__).resolve().parents[1]

DOCUMENTS = [
    ROOT / "README.md",
    *sorted(ROOT.glob("packages/*/README.md")),
    *sorted(ROOT.glob("plugins/*/README.md")),
]

_BLOCK = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_MARKER = re.compile(r"^(run( ranks=\d+(,\d+)*)?|tested by \S+|excerpt(: .+)?)$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a document."""

    document: Path
    line: int
    language: str
    marker: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.document.relative_to(ROOT).as_posix()}:{self.line}"

    @property
    def ranks(self) -> list[int]:
        found = re.search(r"ranks=([\d,]+)", self.marker)
        return [int(n) for n in found.group(1).split(",")] if found else []


def _blocks() -> list[Block]:
    found = []
    for document in DOCUMENTS:
        text = document.read_text(encoding="utf-8")
        for match in _BLOCK.finditer(text):
            found.append(
                Block(
                    document=document,
                    line=text.count("\n", 0, match.start()) + 1,
                    language=match.group(1),
                    marker=match.group(2).strip(),
                    code=match.group(3),
                )
            )
    return found


BLOCKS = _blocks()


def _of(kind: str, language: str | None = None) -> list[Block]:
    return [
        b
        for b in BLOCKS
        if b.marker.split(":")[0].split(" ")[0] == kind
        and (language is None or b.language == language)
    ]


def test_every_block_says_how_it_is_checked() -> None:
    """Each block's info string is ``run``, ``run ranks=…``, ``tested by PATH`` or ``excerpt``."""
    assert len(BLOCKS) > 30  # the documents were found and parsed
    unmarked = [f"{b.where}: {b.marker}" for b in BLOCKS if not _MARKER.match(b.marker)]
    assert unmarked == [], "say after the language: run, run ranks=1,2, tested by PATH, excerpt"


def test_run_blocks_are_python() -> None:
    """Only Python is run here; shell commands are run by the test a ``tested by`` names."""
    assert [b.where for b in _of("run") if b.language != "python"] == []


@pytest.mark.parametrize("block", _of("tested"), ids=lambda b: b.where)
def test_tested_by_names_a_test_that_reads_the_document(block: Block) -> None:
    """The named test exists and reads documents of this name (``README.md``)."""
    path = ROOT / block.marker.removeprefix("tested by ")
    assert path.is_file(), f"{block.where}: {path} does not exist"
    assert path.name.startswith("test_") or path.name == "run", path
    assert "README" in path.read_text(encoding="utf-8"), f"{path} never reads a README"


@pytest.mark.parametrize("block", _of("excerpt", "python"), ids=lambda b: b.where)
def test_python_excerpts_compile(block: Block) -> None:
    """A Python excerpt is still valid Python."""
    compile(block.code, block.where, "exec")


def _shard_commands(code: str) -> list[list[str]]:
    """The ``shard`` argv (after the program name) of each command line of a shell block."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words[:4] == ["python", "-m", "hatch", "run"] and words[4:5] == ["dev:train"]:
            commands.append(["train", *words[5:]])
        elif words[:1] == ["shard"]:
            commands.append(words[1:])
    return commands


SHELL_COMMANDS = [
    (block, argv)
    for block in BLOCKS
    if block.language == "bash"
    for argv in _shard_commands(block.code)
]


@pytest.mark.parametrize(
    ("block", "argv"), SHELL_COMMANDS, ids=[f"{b.where}:{a[0]}" for b, a in SHELL_COMMANDS]
)
def test_shard_command_lines_parse(block: Block, argv: list[str]) -> None:
    """Every ``shard`` command a document shows has flags and values shard's parser accepts."""
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{block.where}: shard {shlex.join(argv)} does not parse ({exc})")


def test_config_excerpt_keys_are_train_flags() -> None:
    """README's ``--config`` example uses only keys that are ``shard train`` flags."""
    (block,) = [b for b in BLOCKS if b.language == "toml" and "shard train's flags" in b.marker]
    flags = {action.dest for action in train_parser()._actions}
    keys = set(tomllib.loads(block.code))
    assert keys - flags == set(), f"{block.where}: not flags of shard train"


ENTRY_POINT_BLOCKS = [b for b in BLOCKS if "[project.entry-points.shard]" in b.code]


@pytest.mark.parametrize("block", ENTRY_POINT_BLOCKS, ids=lambda b: b.where)
def test_entry_point_blocks_are_the_plugins_own(block: Block) -> None:
    """An entry-point table shown is the plugin's real one (the top README shows the example's)."""
    home = block.document.parent
    if home == ROOT:
        home = ROOT / "plugins" / "shard-wrap-example"
    with (home / "pyproject.toml").open("rb") as file:
        real = tomllib.load(file)["project"]["entry-points"]["shard"]
    assert tomllib.loads(block.code)["project"]["entry-points"]["shard"] == real


@pytest.mark.parametrize("block", _of("excerpt", "toml"), ids=lambda b: b.where)
def test_toml_excerpts_parse(block: Block) -> None:
    """A TOML excerpt is valid TOML."""
    tomllib.loads(block.code)


# ------------------------------------------------------------------ running


_DRIVER = """
import os, sys, traceback
failures = []
for where, code in BLOCKS:
    try:
        exec(compile(code, where, "exec"), {"__name__": "__main__"})
    except BaseException:
        failures.append(where + "\\n" + traceback.format_exc())
print("\\n".join(failures))
sys.stdout.flush()
os._exit(1 if failures else 0)
"""


def test_run_blocks_run_as_printed_in_a_world_of_one(tmp_path: Path) -> None:
    """Every ``run`` block runs, in document order, each in a fresh namespace, in one process."""
    blocks = [(b.where, b.code) for b in _of("run") if not b.ranks]
    assert blocks, "no run blocks found"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    done = subprocess.run(
        [sys.executable, "-c", f"BLOCKS = {blocks!r}\n{_DRIVER}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _exec_block(code: str, where: str, cwd: str) -> None:
    """Run one block on a rank, from ``cwd`` (the pool restores the working directory)."""
    os.chdir(cwd)
    exec(compile(code, where, "exec"), {"__name__": "__main__"})


RANKED = [(b, n) for b in _of("run") for n in b.ranks]


@pytest.mark.parametrize(("block", "world_size"), RANKED, ids=[f"{b.where}-{n}" for b, n in RANKED])
def test_run_blocks_run_as_printed_on_ranks(
    block: Block, world_size: int, rank_pool: RankPool, tmp_path: Path
) -> None:
    """A distributed block runs on every rank at each world size it lists."""
    rank_pool.run(_exec_block, world_size, block.code, block.where, str(tmp_path))


def test_readme_plugin_block_is_a_working_plugin() -> None:
    """README's plugin module, registered as a plugin, offers name_pattern, which plans units."""
    (block,) = [b for b in _of("run") if "def shard_wrap_policies" in b.code]
    plugin = types.ModuleType("readme_wrap_plugin")
    exec(compile(block.code, block.where, "exec"), plugin.__dict__)
    pm = make_plugin_manager(load_entry_points=False)
    pm.register(plugin, name="readme_wrap_plugin")
    policy = Registry(pm).wrap_policy("name_pattern", pattern=r"layers\.\d+")
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
    assert [t.name for t in plan_wraps(model, policy)] == ["layers.0", "layers.1", ""]
