"""Install hints never point at the public index's unrelated ``shard-cli`` project."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from shard_cli._model_source import load_model_source

ROOT = Path(__file__).resolve().parents[3]


def test_hf_config_without_transformers_names_a_safe_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A missing transformers says what to install, from this checkout for the extra."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ValueError, match="needs the transformers package") as excinfo:
        load_model_source(hf_config=str(ROOT / "examples" / "llama" / "config.json"))
    message = str(excinfo.value)
    assert "pip install transformers" in message
    assert "pip install './packages/shard-cli[hf]'" in message


def test_no_product_hint_installs_shard_distributions_from_the_index() -> None:
    """`pip install shard-...` with a bare name would fetch an unrelated project."""
    offenders = []
    for path in sorted((ROOT / "packages").glob("*/src/**/*.py")) + sorted(
        (ROOT / "plugins").glob("*/src/**/*.py")
    ):
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(r"pip install ['\"]?(shard[\w-]*)", text):
            offenders.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
    assert offenders == []
