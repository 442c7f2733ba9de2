"""``shard --help`` and argument errors start without torch: the parser is built from light modules.

Each test runs a fresh interpreter, as the ``shard`` console script does, so
modules another test imported do not hide an import the command line makes.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "shard_runtime", "shard_comms", "shard_checkpoint", "shard_core")

# Prints, on its last line, the heavy modules loaded after running ``CALLS``.
_PROBE = """\
import contextlib, io, sys
from shard_cli.__main__ import build_parser, main
build_parser()
for args in {calls!r}:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(args)
        except SystemExit:
            pass
print(sorted(m for m in {heavy!r} if m in sys.modules))
"""


def _heavy_modules_after(calls: list[list[str]]) -> str:
    code = _PROBE.format(calls=calls, heavy=HEAVY)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return result.stdout.strip().splitlines()[-1]


def test_importing_the_package_loads_no_torch() -> None:
    """``import shard_cli`` is cheap: its public names load their modules when first read."""
    code = "import sys, shard_cli\nprint(sorted(m for m in {heavy!r} if m in sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", code.format(heavy=HEAVY)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "command",
    [[], ["train"], ["plan"], ["ckpt"], ["ckpt", "inspect"], ["ckpt", "consolidate"], ["debug"]],
    ids=lambda command: " ".join(command) or "shard",
)
def test_help_loads_no_torch(command: list[str]) -> None:
    """Building the parser and printing a command's ``--help`` imports neither torch nor shard's
    runtime, communication or checkpoint packages."""
    assert _heavy_modules_after([[*command, "--help"]]) == "[]"


def test_argument_errors_load_no_torch() -> None:
    """A mistyped command line is refused before anything heavy is imported."""
    calls = [[], ["train", "--bogus"], ["plan", "--preset", "nope"], ["ckpt"], ["debug", "x"]]
    assert _heavy_modules_after(calls) == "[]"


def test_public_names_still_resolve() -> None:
    """Every name of ``shard_cli.__all__`` is the object its private module defines."""
    import shard_cli
    from shard_cli import _ckpt_inspect, _plan, _presets

    assert shard_cli.PRESETS is _presets.PRESETS
    assert shard_cli.inspect_checkpoint is _ckpt_inspect.inspect_checkpoint
    assert shard_cli.PlanConfig is _plan.PlanConfig
    assert all(hasattr(shard_cli, name) for name in shard_cli.__all__)
    assert {*shard_cli._MODULE_OF, "__version__"} == set(shard_cli.__all__)
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = shard_cli.no_such_name  # type: ignore[attr-defined]
