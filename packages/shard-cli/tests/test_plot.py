"""training.png: both renderers draw valid PNGs of the documented size with the right labels.

The builtin renderer's labels are read back from its pixels (see
``test_png.read_text``); matplotlib's are its own business, so for it the
tests check the file and its size. Which renderer runs depends on whether
matplotlib imports, so the tests hide it through ``sys.modules``.
"""

from __future__ import annotations

import math
import struct
import subprocess
import sys
import zlib

import pytest

from shard_cli._plot import (
    BUILTIN_SIZE,
    MATPLOTLIB_SIZE,
    MEMORY_KINDS,
    MEMORY_TITLE,
    PANELS,
    STEP_LABEL,
    RankMemory,
    _ceiling,
    _nice_range,
    _number,
    available_renderer,
    builtin_chart,
    memory_unit,
    training_chart,
)
from shard_cli._png import FONT, GLYPH_HEIGHT, WHITE, Canvas, missing_glyphs

RECORDS = [
    {
        "step": step,
        "loss": 1.3 + 3.0 * math.exp(-step / 8),
        "tokens_per_s": 4000.0 + 50 * step,
        "elapsed_s": 0.1 * step,
        "step_s": 0.6 if step == 1 else 0.08 + 0.001 * (step % 3),
    }
    for step in range(1, 21)
]
RANKS: list[RankMemory] = [
    ("rank 0", 1_256_000, 1_256_000, 2_512_000, 35_000_000),
    ("rank 1", 1_256_000, 1_256_000, 2_512_000, 35_200_000),
]
TITLE = "shard train: small, 2 ranks"


def read_png(data: bytes) -> tuple[int, int, int]:
    """(width, height, channels) of an 8-bit PNG, checking the chunks' CRCs and the pixel data.

    Accepts what matplotlib writes (RGBA, several IDAT chunks, text chunks).
    """
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, kinds, idat = 8, [], b""
    header = b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        kinds.append(kind)
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert kinds[0] == b"IHDR"
    assert kinds[-1] == b"IEND"
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert (depth, interlace) == (8, 0)
    channels = {2: 3, 6: 4}[color]
    raw = zlib.decompress(idat)
    assert len(raw) == height * (1 + channels * width)
    return width, height, channels


def builtin_pixels(data: bytes) -> Canvas:
    """The builtin chart's pixels on a Canvas (it writes RGB with filter 0 on every row)."""
    width, height, channels = read_png(data)
    assert channels == 3
    idat = data[data.index(b"IDAT") + 4 : data.index(b"IEND") - 8]
    raw = zlib.decompress(idat)
    canvas = Canvas(width, height)
    stride = 1 + 3 * width
    for y in range(height):
        assert raw[y * stride] == 0
        canvas.pixels[y * width * 3 : (y + 1) * width * 3] = raw[y * stride + 1 : (y + 1) * stride]
    return canvas


def ink_rows(canvas: Canvas) -> list[str]:
    """Each pixel row of ``canvas`` as text: "#" where something is drawn, "." where white."""
    white = bytes(WHITE)
    return [
        "".join(
            "." if canvas.pixels[i : i + 3] == white else "#"
            for i in range(y * canvas.width * 3, (y + 1) * canvas.width * 3, 3)
        )
        for y in range(canvas.height)
    ]


def find_text(rows: list[str], text: str) -> tuple[int, int] | None:
    """Where ``text`` is drawn at scale 1 (its cell's top-left), matching every glyph row."""
    pattern = [".".join(FONT[ch][r] for ch in text) for r in range(GLYPH_HEIGHT)]
    for y in range(len(rows) - GLYPH_HEIGHT + 1):
        x = rows[y].find(pattern[0])
        while x >= 0:
            if all(rows[y + r][x : x + len(pattern[r])] == pattern[r] for r in range(GLYPH_HEIGHT)):
                return x, y
            x = rows[y].find(pattern[0], x + 1)
    return None


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """matplotlib as if not installed: ``import matplotlib`` (and its submodules) raises."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_every_label_has_glyphs() -> None:
    """The fallback prints every title, unit and legend of the chart in real glyphs, none as "?"."""
    labels = [p.title for p in PANELS] + [p.ylabel for p in PANELS] + [p.unit for p in PANELS]
    labels += [*MEMORY_KINDS, MEMORY_TITLE, STEP_LABEL, "KiB", "MiB", "GiB", TITLE]
    labels += [_number(v) for v in (0, 0.5, 3.25, 12.5, 750, 12_500, 3.5e6)]
    assert missing_glyphs("".join(labels)) == set()


def test_builtin_chart_is_a_valid_png_with_its_labels_readable() -> None:
    """The fallback is a 960x600 RGB PNG whose titles, units and legend read back as written."""
    data = builtin_chart(RECORDS, RANKS, title=TITLE)
    assert read_png(data) == (*BUILTIN_SIZE, 3)
    rows = ink_rows(builtin_pixels(data))
    expected = [f"{p.title}: {p.ylabel}" for p in PANELS]
    expected += [f"{MEMORY_TITLE}: MiB", *MEMORY_KINDS, "rank 0", "rank 1", STEP_LABEL]
    for label in expected:
        assert find_text(rows, label) is not None, label


def test_builtin_chart_draws_curves_and_bars() -> None:
    """The curves and all four kinds of memory bar leave their colors on the image."""
    canvas = builtin_pixels(builtin_chart(RECORDS, RANKS, title=TITLE))
    colors = {bytes(canvas.pixels[i : i + 3]) for i in range(0, len(canvas.pixels), 3)}
    for color in ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)):
        assert bytes(color) in colors


def test_builtin_chart_says_when_a_warm_up_step_is_off_scale() -> None:
    """A first step at 600 ms among 80 ms steps is left off the axis and named in the panel."""
    rows = ink_rows(builtin_pixels(builtin_chart(RECORDS, RANKS, title=TITLE)))
    assert find_text(rows, "step 1: 600 ms, off scale") is not None


def test_builtin_chart_without_data_is_still_a_png() -> None:
    """No records and no ranks (a run that stopped at once) give an empty chart, not an error."""
    rows = ink_rows(builtin_pixels(builtin_chart([], [], title=TITLE)))
    assert find_text(rows, "no data") is not None


def test_matplotlib_chart_is_a_valid_png_of_the_documented_size() -> None:
    """With matplotlib, training.png is a 1200x750 PNG."""
    pytest.importorskip("matplotlib")
    data = training_chart(RECORDS, RANKS, title=TITLE, renderer="matplotlib")
    width, height, _ = read_png(data)
    assert (width, height) == MATPLOTLIB_SIZE
    assert read_png(training_chart([], [], title=TITLE, renderer="matplotlib"))[:2] == (
        MATPLOTLIB_SIZE
    )


def test_matplotlib_is_chosen_when_installed() -> None:
    """Without a renderer named, an installed matplotlib draws the chart."""
    pytest.importorskip("matplotlib")
    assert available_renderer() == "matplotlib"
    assert read_png(training_chart(RECORDS, RANKS, title=TITLE))[:2] == MATPLOTLIB_SIZE


@pytest.mark.usefixtures("no_matplotlib")
def test_missing_matplotlib_selects_the_builtin_renderer() -> None:
    """Without matplotlib the chart is the builtin one: 960x600 RGB, no ImportError."""
    assert available_renderer() == "builtin"
    assert read_png(training_chart(RECORDS, RANKS, title=TITLE)) == (*BUILTIN_SIZE, 3)


def test_importing_the_cli_does_not_import_matplotlib() -> None:
    """shard train's start pays nothing for the plot: matplotlib loads only when drawing."""
    code = (
        "import sys, shard_cli, shard_cli.__main__, shard_cli._train, shard_cli._plot\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("largest", "unit"),
    [(0, "KiB"), (500_000, "KiB"), (2**20, "MiB"), (35e6, "MiB"), (3 * 2**30, "GiB")],
)
def test_memory_unit_reads_at_least_one(largest: float, unit: str) -> None:
    """Bars are in the largest binary unit the biggest value fills at least once."""
    assert memory_unit(largest)[0] == unit


def test_nice_range_spans_the_data_in_round_steps() -> None:
    """Axis limits widen to 3-6 round steps: 4815..14998 tokens/s is 4000..16000 by 2000."""
    assert _nice_range(4815, 14998) == (4000, 16000, 6)
    assert _nice_range(2.09, 5.16) == (2.0, 6.0, 4)
    assert _nice_range(0.0, 36.8) == (0.0, 40.0, 4)
    low, high, _ = _nice_range(3.0, 3.0)
    assert low <= 3.0 < high


def test_ceiling_leaves_only_outliers_off_scale() -> None:
    """A warm-up step five times the median is cut off; ordinary variation is not."""
    assert _ceiling([80.0, 85.0, 90.0, 82.0]) is None
    assert _ceiling([600.0, 80.0, 85.0, 90.0, 82.0]) == pytest.approx(90.0 * 1.15)
