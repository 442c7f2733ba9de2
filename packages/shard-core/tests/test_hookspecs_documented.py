"""Every hook specification is documented, in its docstring and in the package README."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from shard_core.plugin import hookspecs

README = Path(__file__).resolve().parents[1] / "README.md"

HOOKSPECS = sorted(
    name
    for name, obj in vars(hookspecs).items()
    if inspect.isfunction(obj) and hasattr(obj, f"{hookspecs.PROJECT_NAME}_spec")
)


def test_hookspecs_are_found() -> None:
    """The check below sees the five hooks of the plugin registry (and cannot pass on none)."""
    assert HOOKSPECS == [
        "shard_comm_codecs",
        "shard_comm_hooks",
        "shard_device_handle",
        "shard_state_dict_backend",
        "shard_wrap_policies",
    ]


@pytest.mark.parametrize("name", HOOKSPECS)
def test_hookspec_has_a_docstring(name: str) -> None:
    """A hook specification says what it returns in its docstring."""
    doc = inspect.getdoc(getattr(hookspecs, name))
    assert doc is not None
    assert len(doc.split()) >= 10


@pytest.mark.parametrize("name", HOOKSPECS)
def test_hookspec_is_in_the_readme(name: str) -> None:
    """A hook specification is described in packages/shard-core/README.md."""
    assert f"`{name}" in README.read_text(encoding="utf-8")


@pytest.mark.parametrize("name", HOOKSPECS)
def test_hookspec_is_exported(name: str) -> None:
    """A hook specification is listed in the hookspecs module's __all__."""
    assert name in hookspecs.__all__
