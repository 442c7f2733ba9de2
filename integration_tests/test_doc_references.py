"""Every Markdown document the repository refers to is in the repository.

A newcomer follows references: ARCHITECTURE.md sends them to DESIGN.md, a
docstring to ``tools/bench/README.md``, a comment to "DESIGN.md, section 1".
This test reads every tracked text file (``git ls-files``: ``.md``, ``.py``,
``.toml``, ``.sh``, ``.txt``) and collects three kinds of reference:

- Markdown links ``[text](path.md)`` or ``[text](path.md#anchor)``, resolved
  as a renderer does: relative to the referring file (``/path`` means the
  repository root);
- paths written out in prose or code (``DESIGN.md``,
  ``packages/shard-core/README.md``), which may be relative to the referring
  file or to the repository root;
- numbered sections (``DESIGN.md, section 1``), which need a heading
  ``## 1. ...`` in that document. Anchors need a heading with that slug.

These are not references to our documents, and are skipped: URLs; paths
outside the repository (absolute, or ``../`` past the root); a file named
after a command-line option (``--report fuzz.md`` names an output, not a
document); templated paths (``{distribution}/README.md``); and a document
named right after another project (``torchtitan CONTRIBUTING.md``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pytest

from ._workspace import ROOT

SCANNED_SUFFIXES = (".md", ".py", ".toml", ".sh", ".txt")
SKIPPED_DIRECTORIES = frozenset({"vendor", "_vendor", "third_party", "node_modules"})
# This file names missing documents on purpose, as the scanner's own test cases.
SKIPPED_FILES = frozenset({Path(__file__).resolve().relative_to(ROOT).as_posix()})

_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+", re.IGNORECASE)
_LINK = re.compile(r"\[[^\]\n]*\]\(\s*<?([^)\s>]+\.md(?:#[^)\s>]*)?)>?(?:\s+\"[^\"]*\")?\s*\)")
_PATH = re.compile(r"(?<![\w.~/-])(\.{0,2}/?(?:[\w.-]+/)*[\w-]+\.md)(#[\w-]+)?(?![\w/-])")
_SECTION = re.compile(r"(?<![\w.~/-])([\w./-]+\.md)`?,?\s+sections?\s+(\d+)")
_TEMPLATED = frozenset("{}<>$*")
_OPTION_BEFORE = re.compile(r"--[\w-]+[ =]$")
_FOREIGN_BEFORE = re.compile(
    r"\b(?:pytorch|torch|torchtitan|torchao|pluggy|hatch|hatchling|tox|datasette|llm|"
    r"opentelemetry[\w-]*|lightning|accelerate|peft|transformers|fairscale|deepspeed)"
    r"(?:'s)?[\s`'\"]*$",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Reference:
    """One reference: where it is written, the text, and the document it must resolve to."""

    source: str  # repository-relative path of the referring file
    line: int
    text: str
    candidates: tuple[PurePosixPath, ...]  # repository-relative; the first that exists wins
    anchor: str | None = None
    section: int | None = None

    def where(self) -> str:
        return f"{self.source}:{self.line}: {self.text!r}"


def _inside(path: PurePosixPath) -> PurePosixPath | None:
    """``path`` normalized, or ``None`` when it leaves the repository."""
    parts: list[str] = []
    for part in path.parts:
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                return None
            parts.pop()
        else:
            parts.append(part)
    return PurePosixPath(*parts) if parts else None


def _candidates(source: str, target: str, *, link: bool) -> tuple[PurePosixPath, ...]:
    """Where ``target``, written in ``source``, may point inside the repository."""
    if target.startswith("/"):
        # A link to /x.md means the repository root; a written-out /x.md is an absolute path.
        return tuple(p for p in [_inside(PurePosixPath(target[1:]))] if p) if link else ()
    here = PurePosixPath(source).parent
    bases = [here] if link or target.startswith(".") else [here, PurePosixPath()]
    found = (_inside(base / target) for base in bases)
    return tuple(dict.fromkeys(p for p in found if p is not None))


def references_in(source: str, text: str) -> list[Reference]:
    """Every reference to a Markdown document in ``text``, the contents of file ``source``."""
    found: list[Reference] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if ".md" not in raw:
            continue
        line = _URL.sub(lambda m: " " * len(m.group()), raw)
        linked: set[int] = set()
        sectioned: set[int] = set()  # a section reference is also the document's
        for match in _LINK.finditer(line):
            target, _, anchor = match.group(1).partition("#")
            linked.update(range(match.start(), match.end()))  # its text too
            candidates = _candidates(source, target, link=True)
            if candidates:
                found.append(Reference(source, number, match.group(1), candidates, anchor or None))
        for match in _SECTION.finditer(line):
            candidates = _candidates(source, match.group(1), link=False)
            if candidates and not _FOREIGN_BEFORE.search(line[: match.start()]):
                sectioned.add(match.start())
                section = int(match.group(2))
                found.append(Reference(source, number, match.group(0), candidates, None, section))
        for match in _PATH.finditer(line):
            if match.start() in linked or match.start() in sectioned:
                continue
            before = line[: match.start()]
            if before[-1:] in _TEMPLATED or _OPTION_BEFORE.search(before):
                continue
            if _FOREIGN_BEFORE.search(before):
                continue
            candidates = _candidates(source, match.group(1), link=False)
            if candidates:
                anchor = (match.group(2) or "")[1:] or None
                found.append(Reference(source, number, match.group(0), candidates, anchor))
    return found


def _slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def problem(reference: Reference, root: Path) -> str | None:
    """Why ``reference`` does not resolve under ``root``, or ``None`` when it does."""
    target = next((root / p for p in reference.candidates if (root / p).is_file()), None)
    if target is None:
        tried = " or ".join(p.as_posix() for p in reference.candidates)
        return f"{reference.where()} names a document that does not exist ({tried})"
    if reference.anchor is None and reference.section is None:
        return None
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*$", target.read_text(encoding="utf-8"), re.M)
    if reference.anchor is not None and reference.anchor not in {_slug(h) for h in headings}:
        return f"{reference.where()}: {target.relative_to(root)} has no heading #{reference.anchor}"
    if reference.section is not None and not any(
        re.match(rf"{reference.section}\.?\s", h) for h in headings
    ):
        return f"{reference.where()}: {target.relative_to(root)} has no section {reference.section}"
    return None


def _tracked_text_files() -> list[str]:
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    ).stdout.split("\0")
    return [
        name
        for name in listed
        if name.endswith(SCANNED_SUFFIXES)
        and name not in SKIPPED_FILES
        and not SKIPPED_DIRECTORIES.intersection(PurePosixPath(name).parts)
        and (ROOT / name).is_file()  # a tracked file deleted in the work tree is not read
    ]


def test_every_referenced_document_exists() -> None:
    """Each reference to a Markdown document in a tracked file resolves to a file in the
    repository (and to its section or anchor); every broken one is listed with file:line."""
    files = _tracked_text_files()
    references = [
        ref
        for name in files
        for ref in references_in(name, (ROOT / name).read_text(encoding="utf-8", errors="replace"))
    ]
    problems = [p for p in (problem(ref, ROOT) for ref in references) if p is not None]
    assert not problems, "\n".join(["references to missing documents:", *problems])
    # The scan found what it must: a scanner that matches nothing would pass on anything.
    assert {"ARCHITECTURE.md", "DESIGN.md"} <= {ref.candidates[-1].as_posix() for ref in references}


def test_the_scanner_finds_and_skips_what_it_should(tmp_path: Path) -> None:
    """The scanner resolves links relative to their file, written-out paths relative to the
    file or the root, checks sections and anchors, and skips URLs, outside paths, option
    arguments, templates and other projects' documents."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "DESIGN.md").write_text("# d\n\n## 1. Layers\n", encoding="utf-8")
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## Getting started\n", "utf-8")
    text = "\n".join(
        [
            "See [the guide](guide.md#getting-started) and DESIGN.md, section 1.",  # 1: fine
            "The map: docs/guide.md; the why: `DESIGN.md`.",  # 2: fine (root-relative)
            "Broken: [x](../DESIGN.md#nope) and MISSING.md and DESIGN.md, section 2.",  # 3
            "https://github.com/o/r/blob/main/OTHER.md and ../../outside/X.md /abs/Y.md",
            "run.py --report fuzz.md; f'{name}/README.md'; torchtitan `CONTRIBUTING.md`",
        ]
    )
    refs = references_in("docs/page.md", text)
    assert [(r.line, r.text) for r in refs] == [
        (1, "guide.md#getting-started"),
        (1, "DESIGN.md, section 1"),
        (2, "docs/guide.md"),
        (2, "DESIGN.md"),
        (3, "../DESIGN.md#nope"),
        (3, "DESIGN.md, section 2"),
        (3, "MISSING.md"),
    ]
    problems = [p for p in (problem(r, tmp_path) for r in refs) if p is not None]
    assert [p.split(":")[1] for p in problems] == ["3", "3", "3"]
    assert "has no heading #nope" in problems[0]
    assert "has no section 2" in problems[1]
    assert "does not exist" in problems[2]
