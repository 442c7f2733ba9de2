"""The "Switching from PyTorch FSDP" table: every public PyTorch FSDP name and shard's counterpart.

Run with the project's environment, from the repository root::

    .venv/bin/python tools/compat/compat_table.py                    # print the table
    .venv/bin/python tools/compat/compat_table.py --write README.md  # refresh README's copy
    .venv/bin/python tools/compat/compat_table.py --check            # fail if stale or MISSING

The public names are defined here, by :func:`surfaces` (the tool needs
nothing outside this repository): the ``__all__`` of ``torch.distributed.fsdp``,
``torch.distributed.fsdp.wrap`` and ``torch.distributed.checkpoint.state_dict``,
plus the public attributes that ``FSDPModule`` and ``FullyShardedDataParallel``
add to ``nn.Module``. Each is looked up where switching puts it
(``shard_runtime``, ``shard_runtime.wrap``, ``shard_checkpoint``) and
classified; see [Note: what "same" means]. ``compat_differences.toml`` beside
this file says why a name differs or is absent, and, in its ``[behaviour]``
table, where a name that looks the same behaves differently on purpose (the
table's "behaviour" column). The table is generated, never edited by hand,
so it cannot drift from the code: ``integration_tests/test_compat_table.py``
fails when it has.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import inspect
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "DATA_FILE",
    "END_MARKER",
    "README",
    "SECTION",
    "START_MARKER",
    "Notes",
    "Row",
    "Status",
    "Surface",
    "classify",
    "compare",
    "load_notes",
    "main",
    "readme_table",
    "render",
    "replace_table",
    "stale_entries",
    "summary",
    "surfaces",
    "torch_names",
    "unused_entries",
]

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DATA_FILE = Path(__file__).with_name("compat_differences.toml")
SECTION = "## Switching from PyTorch FSDP"
START_MARKER = "<!-- compat-table:start -->"
END_MARKER = "<!-- compat-table:end -->"

# [Note: what "same" means]
# A shard name is "same" as PyTorch's when code written against PyTorch keeps
# working after the import line changes, judged by what can be introspected:
# - a callable (function, method, class constructor): the same parameters in
#   the same order, each with the same name, kind (positional-only, keyword-
#   only, *args...) and default. A parameter shard adds counts as a difference
#   too: the table says "same" only for an exact match, and every difference is
#   explained in the data file. A PyTorch signature of only (*args, **kwargs)
#   (FSDPModule's __new__) names nothing, so any shard signature matches it.
#   Underscored parameters with a default are private on either side (as
#   every underscored name is) and are left out of the comparison.
# - a dataclass: the same fields in the same order, with the same defaults
#   (a default factory is compared by what it builds) and init/keyword-only
#   flags; underscored fields with a default are private and left out.
# - an enum: the same member names (values are PyTorch's business).
# - a property: a property in shard too.
# - a type alias (checkpoint's ValueType...): the same structure, types
#   compared by class name (modules differ by design), union members unordered.
# Defaults are compared by a module-free description: enum members by
# "Class.MEMBER", classes and functions by qualified name, the rest by repr().


class Status(enum.Enum):
    """How a PyTorch name fares in shard; the table prints the value."""

    SAME = "same"
    DOCUMENTED = "documented difference"
    NOT_APPLICABLE = "not applicable"
    # Present but different, and the data file does not say how: a failure.
    UNDOCUMENTED = "UNDOCUMENTED difference"
    # Absent, and the data file does not say why: a failure.
    MISSING = "MISSING"


@dataclass(frozen=True, slots=True)
class Surface:
    """One PyTorch module and the shard module that stands in for it.

    Attributes:
        prefix: How row names start (``"fsdp"``: ``fsdp.fully_shard``).
        torch_module: The PyTorch module; its ``__all__`` is its public surface.
        shard_name: The import name of shard's counterpart (``"shard_runtime"``).
        shard_module: That module, or ``None`` where it cannot be imported
            (every name is then absent).
        method_classes: Classes of ``torch_module`` whose public attributes get
            rows of their own (``fsdp.FSDPModule.unshard``).
        method_base: Attributes these classes share with this base are not
            theirs to list (``nn.Module``'s ``state_dict``...).
    """

    prefix: str
    torch_module: types.ModuleType
    shard_name: str
    shard_module: types.ModuleType | None
    method_classes: tuple[str, ...] = ()
    method_base: type = object


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the table.

    Attributes:
        name: The PyTorch name, relative to ``torch.distributed``.
        shard: The counterpart's dotted name; ``None`` when it is absent.
        status: How the name fares.
        note: Why (documented differences and non-applicable names, from the
            data file) or what differs (undocumented differences, computed).
        behaviour: Where shard behaves differently on purpose though the name
            may match (the data file's ``[behaviour]`` table); empty: as PyTorch.
    """

    name: str
    shard: str | None
    status: Status
    note: str
    behaviour: str = ""


@dataclass(frozen=True, slots=True)
class Notes:
    """The data file: explanations of differences, by PyTorch name.

    Attributes:
        differences: How shard's counterpart differs, for names shard has.
        not_applicable: Why shard has no counterpart, for names it lacks.
        behaviour: Deliberate differences of behaviour (not of signature), by
            name; they do not change a row's status.
    """

    differences: Mapping[str, str]
    not_applicable: Mapping[str, str]
    behaviour: Mapping[str, str] = dataclasses.field(default_factory=dict)


class _Absent:
    """Marks a counterpart shard does not have (``None`` is a legitimate value)."""

    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()


# ---------------------------------------------------------------------------
# Collecting the names
# ---------------------------------------------------------------------------


def surfaces() -> list[Surface]:
    """The three PyTorch modules the table covers, each with shard's counterpart."""
    import torch.distributed.checkpoint.state_dict as torch_state_dict
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.fsdp.wrap as torch_wrap
    from torch import nn

    return [
        Surface(
            "fsdp",
            torch_fsdp,
            "shard_runtime",
            _import("shard_runtime"),
            method_classes=("FSDPModule", "FullyShardedDataParallel"),
            method_base=nn.Module,
        ),
        Surface("fsdp.wrap", torch_wrap, "shard_runtime.wrap", _import("shard_runtime.wrap")),
        Surface(
            "checkpoint.state_dict",
            torch_state_dict,
            "shard_checkpoint",
            _import("shard_checkpoint"),
        ),
    ]


def _import(name: str) -> types.ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _public(obj: object) -> set[str]:
    return {name for name in dir(obj) if not name.startswith("_")}


def _pairs(surface: Surface) -> list[tuple[str, str, object, object]]:
    """(row name, shard name, PyTorch object, shard object or _ABSENT), sorted by row name."""
    out: list[tuple[str, str, object, object]] = []
    torch_all: Sequence[str] = surface.torch_module.__all__
    for name in torch_all:
        theirs = getattr(surface.torch_module, name)
        ours = _lookup(surface.shard_module, name)
        out.append((f"{surface.prefix}.{name}", f"{surface.shard_name}.{name}", theirs, ours))
        if name not in surface.method_classes:
            continue
        for method in sorted(_public(theirs) - _public(surface.method_base)):
            out.append(
                (
                    f"{surface.prefix}.{name}.{method}",
                    f"{surface.shard_name}.{name}.{method}",
                    getattr(theirs, method),
                    _ABSENT if ours is _ABSENT else getattr(ours, method, _ABSENT),
                )
            )
    return sorted(out, key=lambda pair: pair[0])


def _lookup(module: types.ModuleType | None, name: str) -> object:
    if module is None:
        return _ABSENT
    return getattr(module, name, _ABSENT)


def torch_names(all_surfaces: Sequence[Surface]) -> list[str]:
    """Every row name: PyTorch's public names, in table order."""
    return [name for surface in all_surfaces for name, *_ in _pairs(surface)]


# ---------------------------------------------------------------------------
# Comparing one name
# ---------------------------------------------------------------------------


def compare(theirs: object, ours: object) -> list[str]:
    """What differs between PyTorch's object and shard's, in words; empty when they match.

    See [Note: what "same" means].
    """
    if isinstance(theirs, type) and issubclass(theirs, enum.Enum):
        return _compare_enums(theirs, ours)
    if isinstance(theirs, type) and dataclasses.is_dataclass(theirs):
        return _compare_dataclasses(theirs, ours)
    if _is_alias(theirs):
        return _compare_aliases(theirs, ours)
    if isinstance(theirs, property):
        return (
            [] if isinstance(ours, property) else [f"a property in torch, {_kind(ours)} in shard"]
        )
    if callable(theirs):
        return _compare_callables(theirs, ours)
    if theirs == ours:
        return []
    return [f"value {_describe(theirs)} in torch, {_describe(ours)} in shard"]


def _kind(obj: object) -> str:
    if isinstance(obj, type):
        return "an enum" if issubclass(obj, enum.Enum) else "a class"
    if isinstance(obj, property):
        return "a property"
    if callable(obj):
        return "a function"
    return f"a value of type {type(obj).__name__}"


def _compare_enums(theirs: type[enum.Enum], ours: object) -> list[str]:
    if not (isinstance(ours, type) and issubclass(ours, enum.Enum)):
        return [f"an enum in torch, {_kind(ours)} in shard"]
    return _set_difference("member", list(theirs.__members__), list(ours.__members__))


def _set_difference(what: str, theirs: Sequence[str], ours: Sequence[str]) -> list[str]:
    out: list[str] = []
    lacks = [name for name in theirs if name not in ours]
    adds = [name for name in ours if name not in theirs]
    if lacks:
        out.append(f"shard lacks {_plural(what, lacks)} {', '.join(lacks)}")
    if adds:
        out.append(f"shard adds {_plural(what, adds)} {', '.join(adds)}")
    common_theirs = [name for name in theirs if name in ours]
    common_ours = [name for name in ours if name in theirs]
    if not out and common_theirs != common_ours:
        out.append(f"{what} order differs: torch {', '.join(theirs)}; shard {', '.join(ours)}")
    return out


def _plural(what: str, names: Sequence[str]) -> str:
    return what if len(names) == 1 else f"{what}s"


def _compare_dataclasses(theirs: type, ours: object) -> list[str]:
    if not (isinstance(ours, type) and dataclasses.is_dataclass(ours)):
        return [f"a dataclass in torch, {_kind(ours)} in shard"]
    their_fields = {f.name: f for f in dataclasses.fields(theirs) if not _private_field(f)}
    our_fields = {f.name: f for f in dataclasses.fields(ours) if not _private_field(f)}
    out = _set_difference("field", list(their_fields), list(our_fields))
    for name, field in their_fields.items():
        other = our_fields.get(name)
        if other is None:
            continue
        a, b = _field_default(field), _field_default(other)
        if a != b:
            out.append(f"field {name} defaults to {a} in torch, {b} in shard")
        if (field.init, field.kw_only) != (other.init, other.kw_only):
            out.append(
                f"field {name} is {_field_flags(field)} in torch, {_field_flags(other)} in shard"
            )
    return out


def _private_field(field: dataclasses.Field[object]) -> bool:
    has_default = (
        field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING
    )
    return field.name.startswith("_") and has_default


def _field_default(field: dataclasses.Field[object]) -> str:
    if field.default is not dataclasses.MISSING:
        return _describe(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return _describe(field.default_factory())
    return "nothing (required)"


def _field_flags(field: dataclasses.Field[object]) -> str:
    if not field.init:
        return "not an __init__ argument"
    return "keyword-only" if field.kw_only else "positional-or-keyword"


def _is_alias(obj: object) -> bool:
    return isinstance(obj, (types.GenericAlias, types.UnionType)) or (
        typing.get_origin(obj) is not None
    )


def _compare_aliases(theirs: object, ours: object) -> list[str]:
    if ours is _ABSENT or isinstance(ours, (property, types.FunctionType)):
        return [f"a type alias in torch, {_kind(ours)} in shard"]
    a, b = _alias_shape(theirs), _alias_shape(ours)
    if a == b:
        return []
    their_leaves, our_leaves = _alias_leaves(theirs), _alias_leaves(ours)
    if their_leaves == our_leaves:
        return [f"torch's is {a}; shard's is {b}"]
    return _set_difference("type", sorted(their_leaves), sorted(our_leaves))


def _alias_leaves(obj: object) -> set[str]:
    """The names of the types a type alias is built from, at any depth."""
    args = typing.get_args(obj)
    if not args:
        return {_alias_shape(obj)}
    return set().union(*(_alias_leaves(arg) for arg in args))


def _alias_shape(obj: object) -> str:
    """A module-free description of a type alias (union members sorted)."""
    if isinstance(obj, str):
        return repr(obj)
    if isinstance(obj, typing.ForwardRef):
        return repr(obj.__forward_arg__)
    origin = typing.get_origin(obj)
    args = typing.get_args(obj)
    if origin is types.UnionType or origin is typing.Union:
        return " | ".join(sorted(_alias_shape(arg) for arg in args))
    if origin is not None:
        name = getattr(origin, "__name__", repr(origin))
        return f"{name}[{', '.join(_alias_shape(arg) for arg in args)}]"
    if obj is None or obj is type(None):
        return "None"
    if isinstance(obj, type):
        return obj.__name__
    return repr(obj)


def _compare_callables(theirs: object, ours: object) -> list[str]:
    if not callable(ours):
        return [f"{_kind(theirs)} in torch, {_kind(ours)} in shard"]
    their_sig, our_sig = _signature(theirs), _signature(ours)
    if their_sig is None or our_sig is None:
        return []  # a builtin without a signature: presence is all we can tell
    their_params = [p for p in their_sig.parameters.values() if not _private_param(p)]
    our_params = [p for p in our_sig.parameters.values() if not _private_param(p)]
    passthrough = [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]
    if [param.kind for param in their_params] == passthrough:
        return []  # (*args, **kwargs) names nothing; see [Note: what "same" means]
    ours_by_name = {p.name: p for p in our_params}
    out = _set_difference("parameter", [p.name for p in their_params], [p.name for p in our_params])
    for param in their_params:
        other = ours_by_name.get(param.name)
        if other is None:
            continue
        if param.kind != other.kind:
            out.append(
                f"{param.name} is {param.kind.description} in torch, "
                f"{other.kind.description} in shard"
            )
        a, b = _param_default(param), _param_default(other)
        if a != b:
            out.append(f"{param.name} defaults to {a} in torch, {b} in shard")
    return out


def _private_param(param: inspect.Parameter) -> bool:
    return param.name.startswith("_") and param.default is not inspect.Parameter.empty


def _signature(obj: object) -> inspect.Signature | None:
    try:
        return inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _param_default(param: inspect.Parameter) -> str:
    if param.default is inspect.Parameter.empty:
        return "nothing (required)"
    return _describe(param.default)


def _describe(value: object) -> str:
    """A module-free description of a default, so torch's and shard's enums compare equal."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, type) or inspect.isroutine(value):
        return str(getattr(value, "__qualname__", repr(value)))
    return repr(value)


# ---------------------------------------------------------------------------
# Classifying, rendering
# ---------------------------------------------------------------------------


_SECTIONS = ("differences", "not_applicable", "behaviour")


def load_notes(path: Path = DATA_FILE) -> Notes:
    """Read the data file: ``[differences]``, ``[not_applicable]`` and ``[behaviour]`` tables.

    Each holds name = note; ``[behaviour]`` is optional.

    Raises:
        ValueError: a section or a note is malformed; the message names the
            entry and the file.
    """
    with path.open("rb") as file:
        data = tomllib.load(file)
    unknown = sorted(set(data) - set(_SECTIONS))
    if unknown:
        raise ValueError(
            f"{path}: unknown section(s) {', '.join(unknown)}; the file has three tables, "
            f"[differences], [not_applicable] and [behaviour]"
        )
    sections: dict[str, dict[str, str]] = {}
    for section in _SECTIONS:
        entries = data.get(section, {})
        for name, note in entries.items():
            if not isinstance(note, str) or not note.strip():
                raise ValueError(
                    f"{path}: [{section}] {name!r} must be a non-empty string saying why"
                )
        sections[section] = dict(entries)
    both = sorted(set(sections["differences"]) & set(sections["not_applicable"]))
    if both:
        raise ValueError(
            f"{path}: {', '.join(both)} listed both as a difference and as not applicable; keep one"
        )
    return Notes(sections["differences"], sections["not_applicable"], sections["behaviour"])


def classify(all_surfaces: Sequence[Surface], notes: Notes) -> list[Row]:
    """One row per PyTorch public name, in table order."""
    rows: list[Row] = []
    for surface in all_surfaces:
        for name, shard_name, theirs, ours in _pairs(surface):
            row = _classify_one(name, shard_name, theirs, ours, notes)
            rows.append(dataclasses.replace(row, behaviour=notes.behaviour.get(name, "")))
    return rows


def _classify_one(name: str, shard_name: str, theirs: object, ours: object, notes: Notes) -> Row:
    if ours is _ABSENT:
        why = notes.not_applicable.get(name)
        if why is not None:
            return Row(name, None, Status.NOT_APPLICABLE, why)
        return Row(name, None, Status.MISSING, f"{shard_name} does not exist")
    differences = compare(theirs, ours)
    if not differences:
        return Row(name, shard_name, Status.SAME, "")
    how = notes.differences.get(name)
    if how is not None:
        return Row(name, shard_name, Status.DOCUMENTED, how)
    return Row(name, shard_name, Status.UNDOCUMENTED, "; ".join(differences))


def summary(rows: Sequence[Row]) -> str:
    """The line above the table: ``50 of 87 same, 10 documented differences, ...``."""
    count = {status: sum(row.status is status for row in rows) for status in Status}
    return (
        f"{count[Status.SAME]} of {len(rows)} PyTorch FSDP public names same, "
        f"{count[Status.DOCUMENTED]} documented differences, "
        f"{count[Status.NOT_APPLICABLE]} not applicable, "
        f"{count[Status.UNDOCUMENTED]} undocumented differences, "
        f"{count[Status.MISSING]} MISSING."
    )


def render(rows: Sequence[Row]) -> str:
    """The Markdown README shows between the markers: the summary line, then the table."""
    lines = [
        summary(rows),
        "",
        "| PyTorch (`torch.distributed.`) | shard | status | note | behaviour |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        shard = f"`{row.shard}`" if row.shard is not None else "-"
        lines.append(
            f"| `{row.name}` | {shard} | {row.status.value} | {_cell(row.note)} "
            f"| {_cell(row.behaviour)} |"
        )
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def stale_entries(names: Sequence[str], notes: Notes) -> list[str]:
    """Data-file entries naming something PyTorch does not have (renamed or removed there)."""
    known = set(names)
    return sorted(
        f"[{section}] {name}"
        for section, entries in (
            ("differences", notes.differences),
            ("not_applicable", notes.not_applicable),
            ("behaviour", notes.behaviour),
        )
        for name in entries
        if name not in known
    )


def unused_entries(rows: Sequence[Row], notes: Notes) -> list[str]:
    """Entries of PyTorch names whose row does not use them (shard now matches, or has it)."""
    status = {row.name: row.status for row in rows}
    out = [
        f"[differences] {name}: {status[name].value}"
        for name in notes.differences
        if name in status and status[name] is not Status.DOCUMENTED
    ]
    out += [
        f"[not_applicable] {name}: {status[name].value}"
        for name in notes.not_applicable
        if name in status and status[name] is not Status.NOT_APPLICABLE
    ]
    return sorted(out)


# ---------------------------------------------------------------------------
# README
# ---------------------------------------------------------------------------


def _section_bounds(text: str) -> tuple[int, int]:
    start = text.find(f"\n{SECTION}\n")
    if start < 0:
        raise ValueError(f"README has no {SECTION!r} section")
    end = text.find("\n## ", start + 1)
    return start, len(text) if end < 0 else end


def _marker_bounds(text: str) -> tuple[int, int]:
    """Where the generated block starts (after the start marker's line) and ends."""
    start, end = _section_bounds(text)
    section = text[start:end]
    first = section.find(START_MARKER)
    last = section.find(END_MARKER)
    if first < 0 or last < 0 or last < first or section.count(START_MARKER) != 1:
        raise ValueError(
            f"README's {SECTION!r} section needs one {START_MARKER} line and, after it, one "
            f"{END_MARKER} line; the generated table goes between them"
        )
    return start + first + len(START_MARKER) + 1, start + last


def readme_table(text: str) -> str:
    """The generated block README holds now (between the markers)."""
    first, last = _marker_bounds(text)
    return text[first:last]


def replace_table(text: str, table: str) -> str:
    """README's text with ``table`` between the markers; everything else unchanged."""
    first, last = _marker_bounds(text)
    return text[:first] + table + text[last:]


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def main(
    argv: Sequence[str] | None = None,
    *,
    make_surfaces: Callable[[], list[Surface]] = surfaces,
    notes_path: Path = DATA_FILE,
) -> int:
    """Print the table, write it into README (``--write``) or check README's copy (``--check``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", type=Path, metavar="README", help="replace README's table")
    action.add_argument(
        "--check",
        nargs="?",
        const=README,
        type=Path,
        metavar="README",
        help="exit 1 if README's table is not the generated one, or a name is MISSING "
        "or differs undocumented (default README: the repository's)",
    )
    args = parser.parse_args(argv)
    notes = load_notes(notes_path)
    all_surfaces = make_surfaces()
    rows = classify(all_surfaces, notes)
    table = render(rows)
    problems = [
        f"stale entry in {notes_path.name}: {entry}"
        for entry in stale_entries(torch_names(all_surfaces), notes)
    ]
    for entry in unused_entries(rows, notes):
        print(f"note: unused entry in {notes_path.name}: {entry}", file=sys.stderr)
    if args.write is not None:
        path: Path = args.write
        path.write_text(replace_table(path.read_text(encoding="utf-8"), table), encoding="utf-8")
        print(summary(rows))
    elif args.check is not None:
        if readme_table(args.check.read_text(encoding="utf-8")) != table:
            problems.append(
                f"{args.check}'s table is not the generated one: run "
                f"tools/compat/compat_table.py --write {args.check}"
            )
        problems += [_failure(row, notes_path.name) for row in rows if _fails(row)]
        print(summary(rows))
    else:
        print(table, end="")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


def _fails(row: Row) -> bool:
    return row.status in (Status.MISSING, Status.UNDOCUMENTED)


def _failure(row: Row, data_file: str) -> str:
    if row.status is Status.MISSING:
        fix = f"add it to shard, or say why it does not apply in {data_file} [not_applicable]"
    else:
        fix = f"match PyTorch, or explain the difference in {data_file} [differences]"
    return f"{row.status.value}: {row.name} ({row.note}); {fix}"


if __name__ == "__main__":
    sys.exit(main())
