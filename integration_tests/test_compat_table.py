"""README's "Switching from PyTorch FSDP" table: its generator, and that README and shard agree."""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "compat" / "compat_table.py"


def _load_tool() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("compat_table", TOOL)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module


ct: Any = _load_tool()

NO_NOTES = ct.Notes({}, {})


def fake_module(name: str, **attributes: object) -> types.ModuleType:
    """A module holding ``attributes``, all of them public (its ``__all__``)."""
    module = types.ModuleType(name)
    for key, value in attributes.items():
        setattr(module, key, value)
    vars(module)["__all__"] = list(attributes)
    return module


def rows_for(theirs: object, ours: object | None, notes: Any = NO_NOTES) -> list[Any]:
    """Classify one name ``thing``: PyTorch's object against shard's (``None``: shard lacks it)."""
    torch_mod = fake_module("torch_fake", thing=theirs)
    shard_mod = fake_module("shard_fake") if ours is None else fake_module("shard_fake", thing=ours)
    rows: list[Any] = ct.classify([ct.Surface("fake", torch_mod, "shard_fake", shard_mod)], notes)
    return rows


def only_row(theirs: object, ours: object | None, notes: Any = NO_NOTES) -> tuple[str, str]:
    """The status and note of the single row ``fake.thing``."""
    (row,) = rows_for(theirs, ours, notes)
    assert row.name == "fake.thing"
    return row.status.value, row.note


# - classifying callables


def test_identical_signatures_are_same() -> None:
    """Same names, kinds and defaults in the same order is "same", with no note."""

    def theirs(a: int, b: int = 1, *args: int, c: str | None = None, **kw: int) -> None: ...

    def ours(a: int, b: int = 1, *args: int, c: str | None = None, **kw: int) -> None: ...

    assert only_row(theirs, ours) == ("same", "")


def test_missing_and_added_parameters_are_undocumented_differences() -> None:
    """A parameter shard lacks, and one it adds, are both named in the note."""

    def theirs(module: object, mesh: object = None, dp_mesh_dims: object = None) -> None: ...

    def ours(module: object, mesh: object = None, extra: int = 0) -> None: ...

    assert only_row(theirs, ours) == (
        "UNDOCUMENTED difference",
        "shard lacks parameter dp_mesh_dims; shard adds parameter extra",
    )


def test_renamed_parameter_is_a_difference() -> None:
    """set_model_state_dict(model, model_state_dict) vs (model, state_dict) differs."""

    def theirs(model: object, model_state_dict: object) -> None: ...

    def ours(model: object, state_dict: object) -> None: ...

    assert only_row(theirs, ours)[1] == (
        "shard lacks parameter model_state_dict; shard adds parameter state_dict"
    )


def test_reordered_parameters_are_a_difference() -> None:
    """The same names in another order break positional calls: a difference."""

    def theirs(a: int, b: int) -> None: ...

    def ours(b: int, a: int) -> None: ...

    assert only_row(theirs, ours)[1] == "parameter order differs: torch a, b; shard b, a"


def test_default_and_kind_differences_are_named() -> None:
    """A changed default and a parameter made keyword-only are each described."""

    def theirs(x: int, recurse: bool = True, limit: int | None = None) -> None: ...

    def ours(x: int, *, recurse: bool = True, limit: int | None = 4) -> None: ...

    assert only_row(theirs, ours)[1] == (
        "recurse is positional or keyword in torch, keyword-only in shard; "
        "limit is positional or keyword in torch, keyword-only in shard; "
        "limit defaults to None in torch, 4 in shard"
    )


def test_required_against_defaulted_parameter_is_a_difference() -> None:
    """A parameter required in torch but optional in shard is reported as such."""

    def theirs(hook: object) -> None: ...

    def ours(hook: object = None) -> None: ...

    assert (
        only_row(theirs, ours)[1] == "hook defaults to nothing (required) in torch, None in shard"
    )


def test_enum_defaults_compare_by_class_and_member_name() -> None:
    """Defaults that are members of torch's enum and shard's same-named enum compare equal."""

    class Torch:
        class Prefetch(enum.Enum):
            BACKWARD_PRE = 1
            BACKWARD_POST = 2

    class Shard:
        class Prefetch(enum.Enum):
            BACKWARD_PRE = "pre"
            BACKWARD_POST = "post"

    torch_prefetch, shard_prefetch = Torch.Prefetch, Shard.Prefetch

    def theirs(prefetch: object = torch_prefetch.BACKWARD_PRE) -> None: ...

    def ours(prefetch: object = shard_prefetch.BACKWARD_PRE) -> None: ...

    def ours_post(prefetch: object = shard_prefetch.BACKWARD_POST) -> None: ...

    assert only_row(theirs, ours) == ("same", "")
    assert only_row(theirs, ours_post)[1] == (
        "prefetch defaults to Prefetch.BACKWARD_PRE in torch, Prefetch.BACKWARD_POST in shard"
    )


def test_private_parameters_with_defaults_are_ignored() -> None:
    """An underscored parameter with a default, on either side, is not public surface."""

    def theirs(module: object, _use_dtensor: bool = False) -> None: ...

    def ours(module: object, *, _shared: object = None) -> None: ...

    assert only_row(theirs, ours) == ("same", "")


def test_passthrough_signature_matches_anything() -> None:
    """A torch class whose constructor is only (*args, **kwargs) matches any shard class."""

    class Theirs:
        def __new__(cls, *args: object, **kwargs: object) -> Theirs:
            return super().__new__(cls)

    class Ours:
        pass

    assert only_row(Theirs, Ours) == ("same", "")


def test_class_constructor_signatures_are_compared() -> None:
    """A class's constructor parameters are compared like a function's."""

    class Theirs:
        def __init__(self) -> None: ...

    class Ours:
        def __init__(self, state: object) -> None: ...

    assert only_row(Theirs, Ours)[1] == "shard adds parameter state"


def test_function_against_non_callable_is_a_difference() -> None:
    """A name that is a function in torch and a plain value in shard differs."""

    def theirs() -> None: ...

    assert only_row(theirs, 3) == (
        "UNDOCUMENTED difference",
        "a function in torch, a value of type int in shard",
    )


# - classifying enums, dataclasses, properties, aliases


def test_enums_compare_member_names() -> None:
    """Enums with the same members are "same"; a missing or extra member is named."""

    class Theirs(enum.Enum):
        FULL_SHARD = 1
        SHARD_GRAD_OP = 2
        NO_SHARD = 3

    class Same(enum.Enum):
        FULL_SHARD = "a"
        SHARD_GRAD_OP = "b"
        NO_SHARD = "c"

    class Other(enum.Enum):
        FULL_SHARD = 1
        NO_SHARD = 2
        HYBRID_SHARD = 3

    assert only_row(Theirs, Same) == ("same", "")
    assert only_row(Theirs, Other)[1] == (
        "shard lacks member SHARD_GRAD_OP; shard adds member HYBRID_SHARD"
    )


def test_dataclasses_compare_fields_defaults_and_flags() -> None:
    """Fields are compared by name, order, default (factories by their product) and kind."""

    @dataclasses.dataclass
    class Theirs:
        param_dtype: object = None
        ranks: list[int] = dataclasses.field(default_factory=lambda: [0])
        cast: bool = True
        _private: bool = False

    @dataclasses.dataclass
    class Same:
        param_dtype: object = None
        ranks: list[int] = dataclasses.field(default_factory=lambda: [0])
        cast: bool = True

    @dataclasses.dataclass
    class Differs:
        param_dtype: object = None
        ranks: list[int] = dataclasses.field(default_factory=lambda: [1])
        cast: bool = dataclasses.field(default=True, kw_only=True)

    assert only_row(Theirs, Same) == ("same", "")
    assert only_row(Theirs, Differs)[1] == (
        "field ranks defaults to [0] in torch, [1] in shard; "
        "field cast is positional-or-keyword in torch, keyword-only in shard"
    )


def test_dataclass_against_plain_class_is_a_difference() -> None:
    """A dataclass in torch must be a dataclass in shard (its fields are its interface)."""

    @dataclasses.dataclass
    class Theirs:
        x: int = 0

    class Ours:
        x = 0

    assert only_row(Theirs, Ours)[1] == "a dataclass in torch, a class in shard"


def test_properties_match_properties_only() -> None:
    """A property in torch is "same" as a property in shard and differs from a method."""

    class Torch:
        @property
        def module(self) -> int:
            return 0

    class Shard:
        @property
        def module(self) -> int:
            return 1

    class ShardMethod:
        def module(self) -> int:
            return 1

    assert only_row(Torch.__dict__["module"], Shard.__dict__["module"]) == ("same", "")
    assert only_row(Torch.__dict__["module"], ShardMethod.module)[1] == (
        "a property in torch, a function in shard"
    )


def test_type_aliases_compare_types_by_name_and_union_members_unordered() -> None:
    """Aliases built from same-named types in any union order match; a missing type is named."""

    class Torch:
        class Tensor: ...

        class ShardedTensor: ...

    class Shard:
        class Tensor: ...

    assert only_row(dict[str, Torch.Tensor | int], dict[str, int | Shard.Tensor]) == ("same", "")
    assert only_row(Torch.Tensor | Torch.ShardedTensor | int, Shard.Tensor | int)[1] == (
        "shard lacks type ShardedTensor"
    )
    assert only_row(list[int], set[int])[1] == "torch's is list[int]; shard's is set[int]"


# - statuses from the data file


def test_absent_names_are_missing_unless_documented_as_not_applicable() -> None:
    """Absent and unexplained is MISSING; absent with a [not_applicable] note prints the note."""

    def theirs() -> None: ...

    assert only_row(theirs, None) == ("MISSING", "shard_fake.thing does not exist")
    notes = ct.Notes({}, {"fake.thing": "CUDA only."})
    assert only_row(theirs, None, notes) == ("not applicable", "CUDA only.")


def test_documented_differences_print_their_note() -> None:
    """A present, differing name with a [differences] note is a documented difference."""

    def theirs(a: int) -> None: ...

    def ours(b: int) -> None: ...

    notes = ct.Notes({"fake.thing": "Named b here."}, {})
    assert only_row(theirs, ours, notes) == ("documented difference", "Named b here.")


def test_difference_note_does_not_hide_a_match_or_an_absence() -> None:
    """A [differences] note is only used when the name exists and differs."""

    def theirs(a: int) -> None: ...

    notes = ct.Notes({"fake.thing": "Named b here."}, {})
    assert only_row(theirs, theirs, notes) == ("same", "")
    assert only_row(theirs, None, notes)[0] == "MISSING"


def test_method_rows_follow_their_class_and_skip_base_attributes() -> None:
    """Public attributes a class adds to its base get rows; inherited and private ones do not."""

    class Base:
        def state_dict(self) -> None: ...

    class TorchModule(Base):
        def unshard(self, async_op: bool = False) -> None: ...

        def reshard(self) -> None: ...

        def _private(self) -> None: ...

    class ShardModule(Base):
        def unshard(self, async_op: bool = False) -> None: ...

    def fully_shard(module: object) -> None: ...

    torch_mod = fake_module("torch_fake", fully_shard=fully_shard, FSDPModule=TorchModule)
    shard_mod = fake_module("shard_fake", fully_shard=fully_shard, FSDPModule=ShardModule)
    surface = ct.Surface(
        "fsdp", torch_mod, "shard_fake", shard_mod, method_classes=("FSDPModule",), method_base=Base
    )
    rows = ct.classify([surface], NO_NOTES)
    assert [(r.name, r.shard, r.status.value) for r in rows] == [
        ("fsdp.FSDPModule", "shard_fake.FSDPModule", "same"),
        ("fsdp.FSDPModule.reshard", None, "MISSING"),
        ("fsdp.FSDPModule.unshard", "shard_fake.FSDPModule.unshard", "same"),
        ("fsdp.fully_shard", "shard_fake.fully_shard", "same"),
    ]


def test_methods_of_an_absent_class_are_missing() -> None:
    """When shard lacks the class, each of its methods is MISSING too."""

    class TorchModule:
        def unshard(self) -> None: ...

    surface = ct.Surface(
        "fsdp",
        fake_module("torch_fake", FSDPModule=TorchModule),
        "shard_fake",
        fake_module("shard_fake"),
        method_classes=("FSDPModule",),
    )
    assert [(r.name, r.status.value) for r in ct.classify([surface], NO_NOTES)] == [
        ("fsdp.FSDPModule", "MISSING"),
        ("fsdp.FSDPModule.unshard", "MISSING"),
    ]


def test_unimportable_shard_module_makes_every_name_missing() -> None:
    """A counterpart module that cannot be imported (shard_runtime.wrap before it exists)."""

    def wrap() -> None: ...

    surface = ct.Surface("fsdp.wrap", fake_module("t", wrap=wrap), "shard_runtime.wrap", None)
    (row,) = ct.classify([surface], NO_NOTES)
    assert (row.name, row.shard, row.status.value, row.note) == (
        "fsdp.wrap.wrap",
        None,
        "MISSING",
        "shard_runtime.wrap.wrap does not exist",
    )


# - rendering, README, data file


def sample_rows() -> list[Any]:
    return [
        ct.Row("fsdp.a", "shard_runtime.a", ct.Status.SAME, "", "Accepts the CPU."),
        ct.Row("fsdp.b", "shard_runtime.b", ct.Status.DOCUMENTED, "Takes a | b,\n  shorter."),
        ct.Row("fsdp.c", None, ct.Status.NOT_APPLICABLE, "CUDA only."),
        ct.Row("fsdp.d", None, ct.Status.MISSING, "shard_runtime.d does not exist"),
        ct.Row("fsdp.e", "shard_runtime.e", ct.Status.UNDOCUMENTED, "shard lacks parameter x"),
    ]


def test_render_prints_the_summary_line_then_the_table() -> None:
    """The block is a summary line, a blank line and a Markdown table with escaped cells; the
    behaviour column is empty where shard behaves as PyTorch."""
    assert ct.render(sample_rows()) == (
        "1 of 5 PyTorch FSDP public names same, 1 documented differences, 1 not applicable, "
        "1 undocumented differences, 1 MISSING.\n"
        "\n"
        "| PyTorch (`torch.distributed.`) | shard | status | note | behaviour |\n"
        "|---|---|---|---|---|\n"
        "| `fsdp.a` | `shard_runtime.a` | same |  | Accepts the CPU. |\n"
        "| `fsdp.b` | `shard_runtime.b` | documented difference | Takes a \\| b, shorter. |  |\n"
        "| `fsdp.c` | - | not applicable | CUDA only. |  |\n"
        "| `fsdp.d` | - | MISSING | shard_runtime.d does not exist |  |\n"
        "| `fsdp.e` | `shard_runtime.e` | UNDOCUMENTED difference | shard lacks parameter x |  |\n"
    )


README_SAMPLE = (
    "# shard\n\nintro\n\n## Switching from PyTorch FSDP\n\nkept above\n\n"
    "<!-- compat-table:start -->\nold table\n<!-- compat-table:end -->\n\nkept below\n\n"
    "## Packages\n\n<!-- compat-table:start -->\nnot this one\n"
)


def test_replace_table_changes_only_the_block_between_the_markers() -> None:
    """--write's edit keeps the section's prose and everything outside the section."""
    new = ct.replace_table(README_SAMPLE, "new table\n")
    assert new == README_SAMPLE.replace("old table\n", "new table\n", 1)
    assert ct.readme_table(new) == "new table\n"
    assert ct.readme_table(README_SAMPLE) == "old table\n"


def test_readme_without_markers_is_an_error_naming_the_fix() -> None:
    """A section lacking the markers (or README lacking the section) is reported, not guessed."""
    without = "# shard\n\n## Switching from PyTorch FSDP\n\nno table\n\n## Packages\n"
    with pytest.raises(ValueError, match=r"needs one <!-- compat-table:start --> line"):
        ct.readme_table(without)
    with pytest.raises(ValueError, match=r"README has no '## Switching from PyTorch FSDP'"):
        ct.replace_table("# shard\n", "t\n")


def test_stale_and_unused_entries_are_found() -> None:
    """Entries naming what torch lacks are stale; entries their row does not use are unused."""
    notes = ct.Notes(
        {"fsdp.a": "was different", "fsdp.b": "still different", "fsdp.gone": "renamed"},
        {"fsdp.c": "CUDA only.", "fsdp.e": "now present", "fsdp.old": "removed"},
    )
    names = ["fsdp.a", "fsdp.b", "fsdp.c", "fsdp.d", "fsdp.e"]
    assert ct.stale_entries(names, notes) == [
        "[differences] fsdp.gone",
        "[not_applicable] fsdp.old",
    ]
    assert ct.unused_entries(sample_rows(), notes) == [
        "[differences] fsdp.a: same",
        "[not_applicable] fsdp.e: UNDOCUMENTED difference",
    ]


def test_load_notes_reads_the_three_tables(tmp_path: Path) -> None:
    """The data file's [differences], [not_applicable] and optional [behaviour] tables become
    the Notes mappings."""
    path = tmp_path / "notes.toml"
    path.write_text(
        '[differences]\n"fsdp.a" = "A."\n\n[not_applicable]\n"fsdp.b" = "B."\n', encoding="utf-8"
    )
    assert ct.load_notes(path) == ct.Notes({"fsdp.a": "A."}, {"fsdp.b": "B."})
    path.write_text('[behaviour]\n"fsdp.a" = "C."\n', encoding="utf-8")
    assert ct.load_notes(path) == ct.Notes({}, {}, {"fsdp.a": "C."})


def test_behaviour_notes_fill_their_column_without_changing_the_status() -> None:
    """A [behaviour] entry lands in its row's behaviour cell; the row stays "same"."""

    def same() -> None: ...

    notes = ct.Notes({}, {}, {"fake.thing": "Accepts the CPU."})
    (row,) = rows_for(same, same, notes)
    assert (row.status.value, row.note, row.behaviour) == ("same", "", "Accepts the CPU.")
    assert ct.stale_entries(["fake.other"], notes) == ["[behaviour] fake.thing"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[differences]\n"fsdp.a" = ""\n', r"\[differences\] 'fsdp.a' must be a non-empty"),
        (
            '[differences]\n"fsdp.a" = "A."\n[not_applicable]\n"fsdp.a" = "B."\n',
            r"fsdp.a listed both as a difference and as not applicable",
        ),
        ('[diferences]\n"fsdp.a" = "A."\n', r"unknown section\(s\) diferences"),
    ],
)
def test_load_notes_rejects_malformed_files(tmp_path: Path, text: str, message: str) -> None:
    """An empty note, a name in both tables, or a misspelled table is an error."""
    path = tmp_path / "notes.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        ct.load_notes(path)


@pytest.fixture
def fake_project(tmp_path: Path) -> tuple[Path, Path, Any]:
    """A README, a data file and one fake surface where one name is MISSING until explained."""

    def same() -> None: ...

    torch_mod = fake_module("torch_fake", same=same, gone=same)
    surface = ct.Surface("fake", torch_mod, "shard_fake", fake_module("shard_fake", same=same))
    readme = tmp_path / "README.md"
    readme.write_text(README_SAMPLE, encoding="utf-8")
    notes = tmp_path / "notes.toml"
    notes.write_text('[not_applicable]\n"fake.gone" = "Gone."\n', encoding="utf-8")
    return readme, notes, lambda: [surface]


def test_main_writes_then_checks_readme(
    fake_project: tuple[Path, Path, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """--write puts the table in README; --check then passes, and fails once README drifts."""
    readme, notes, make = fake_project
    kwargs = {"make_surfaces": make, "notes_path": notes}
    assert ct.main(["--check", str(readme)], **kwargs) == 1
    assert ct.main(["--write", str(readme)], **kwargs) == 0
    assert ct.readme_table(readme.read_text(encoding="utf-8")) == (
        "1 of 2 PyTorch FSDP public names same, 0 documented differences, 1 not applicable, "
        "0 undocumented differences, 0 MISSING.\n\n"
        "| PyTorch (`torch.distributed.`) | shard | status | note | behaviour |\n"
        "|---|---|---|---|---|\n"
        "| `fake.gone` | - | not applicable | Gone. |  |\n"
        "| `fake.same` | `shard_fake.same` | same |  |  |\n"
    )
    capsys.readouterr()
    assert ct.main(["--check", str(readme)], **kwargs) == 0
    readme.write_text(
        readme.read_text(encoding="utf-8").replace("Gone.", "Went."), encoding="utf-8"
    )
    assert ct.main(["--check", str(readme)], **kwargs) == 1
    assert "README.md's table is not the generated one" in capsys.readouterr().err


def test_check_fails_on_a_missing_name_even_when_readme_is_current(
    fake_project: tuple[Path, Path, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """A MISSING name fails --check although README shows exactly the generated table."""
    readme, notes, make = fake_project
    notes.write_text("", encoding="utf-8")
    kwargs = {"make_surfaces": make, "notes_path": notes}
    assert ct.main(["--write", str(readme)], **kwargs) == 0
    capsys.readouterr()
    assert ct.main(["--check", str(readme)], **kwargs) == 1
    assert capsys.readouterr().err == (
        "MISSING: fake.gone (shard_fake.gone does not exist); add it to shard, or say why it "
        "does not apply in notes.toml [not_applicable]\n"
    )


def test_stale_entry_fails_every_mode(
    fake_project: tuple[Path, Path, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """An entry naming a name torch does not have makes the tool exit 1, even when printing."""
    _, notes, make = fake_project
    notes.write_text(
        '[not_applicable]\n"fake.gone" = "Gone."\n"fake.renamed" = "Old."\n', encoding="utf-8"
    )
    assert ct.main([], make_surfaces=make, notes_path=notes) == 1
    assert capsys.readouterr().err == ("stale entry in notes.toml: [not_applicable] fake.renamed\n")


# - the real table


@pytest.fixture(scope="module")
def real() -> tuple[list[Any], Any, list[str]]:
    """The rows, notes and PyTorch names of this checkout."""
    notes = ct.load_notes()
    all_surfaces = ct.surfaces()
    return ct.classify(all_surfaces, notes), notes, ct.torch_names(all_surfaces)


def test_real_surfaces_cover_the_three_modules_and_both_classes(
    real: tuple[list[Any], Any, list[str]],
) -> None:
    """Rows include module names, FSDPModule and wrapper methods, but no nn.Module method."""
    _, _, names = real
    assert {
        "fsdp.fully_shard",
        "fsdp.FSDPModule.unshard",
        "fsdp.FullyShardedDataParallel.no_sync",
        "fsdp.wrap.ModuleWrapPolicy",
        "checkpoint.state_dict.get_model_state_dict",
    } <= set(names)
    assert "fsdp.FullyShardedDataParallel.state_dict" not in names
    assert "fsdp.FSDPModule.forward" not in names
    assert len(names) == len(set(names))


def test_readme_table_is_the_generated_one(real: tuple[list[Any], Any, list[str]]) -> None:
    """README's table is what compat_table.py generates now (run it with --write README.md)."""
    rows, _, _ = real
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert ct.readme_table(readme) == ct.render(rows)


def test_no_pytorch_public_name_is_missing(real: tuple[list[Any], Any, list[str]]) -> None:
    """Every PyTorch FSDP public name exists in shard or is documented as not applicable."""
    rows, _, _ = real
    assert [row.name for row in rows if row.status is ct.Status.MISSING] == []


def test_no_difference_is_undocumented(real: tuple[list[Any], Any, list[str]]) -> None:
    """Every counterpart that differs from PyTorch's has a note in the data file."""
    rows, _, _ = real
    assert [f"{row.name}: {row.note}" for row in rows if row.status is ct.Status.UNDOCUMENTED] == []


def test_data_file_names_only_pytorch_public_names(
    real: tuple[list[Any], Any, list[str]],
) -> None:
    """No entry of compat_differences.toml refers to a name PyTorch no longer has."""
    _, notes, names = real
    assert ct.stale_entries(names, notes) == []
