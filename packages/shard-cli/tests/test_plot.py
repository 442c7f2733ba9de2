"""training.png: matplotlib draws a valid PNG of the documented size with the right labels.

The PNG's chunks and pixel data are checked byte by byte; the labels, the curves
and the off-scale note are read from the figure matplotlib renders.
"""

from __future__ import annotations

import math
import struct
import subprocess
import sys
import zlib

import pytest

from shard_cli._plot import (
    CHART_SIZE,
    MEMORY_KINDS,
    MEMORY_TITLE,
    PANELS,
    STEP_LABEL,
    RankMemory,
    _ceiling,
    memory_unit,
    training_chart,
    training_figure,
)

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


def test_chart_is_a_valid_png_of_the_documented_size() -> None:
    """training.png is a 1200x750 PNG, with data and without."""
    assert read_png(training_chart(RECORDS, RANKS, title=TITLE))[:2] == CHART_SIZE
    assert read_png(training_chart([], [], title=TITLE))[:2] == CHART_SIZE


def test_chart_labels_panels_units_and_ranks() -> None:
    """Every panel has its title, axis labels and one curve; the bars are per rank and kind."""
    figure = training_figure(RECORDS, RANKS, title=TITLE)
    assert figure.get_suptitle() == TITLE
    loss, memory, throughput, step_time = figure.axes
    for axes, panel in zip((loss, throughput, step_time), PANELS, strict=True):
        assert (axes.get_title(), axes.get_xlabel(), axes.get_ylabel()) == (
            panel.title,
            STEP_LABEL,
            panel.ylabel,
        )
        (line,) = axes.get_lines()
        assert list(line.get_xdata()) == [r["step"] for r in RECORDS]
    assert (memory.get_title(), memory.get_ylabel()) == (MEMORY_TITLE, "MiB")
    assert [t.get_text() for t in memory.get_xticklabels()] == ["rank 0", "rank 1"]
    assert [t.get_text() for t in memory.get_legend().get_texts()] == list(MEMORY_KINDS)
    assert len(memory.patches) == len(RANKS) * len(MEMORY_KINDS)
    loss_values = [t.get_text() for t in loss.texts]
    assert loss_values == [f"{RECORDS[0]['loss']:.3f}", f"{RECORDS[-1]['loss']:.3f}"]


def test_chart_says_when_a_warm_up_step_is_off_scale() -> None:
    """Step 1's 600 ms would flatten the step-time curve: it is cut off, and the panel says so."""
    step_time = training_figure(RECORDS, RANKS, title=TITLE).axes[3]
    assert [t.get_text() for t in step_time.texts] == ["step 1: 600 ms, off scale"]
    assert step_time.get_ylim()[1] < 600


def test_chart_without_data_says_so() -> None:
    """A run without metrics still gets a chart, each panel saying "no data"."""
    figure = training_figure([], [], title=TITLE)
    assert [[t.get_text() for t in axes.texts] for axes in figure.axes] == [["no data"]] * 4


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


def test_ceiling_leaves_only_outliers_off_scale() -> None:
    """A warm-up step five times the median is cut off; ordinary variation is not."""
    assert _ceiling([80.0, 85.0, 90.0, 82.0]) is None
    assert _ceiling([600.0, 80.0, 85.0, 90.0, 82.0]) == pytest.approx(90.0 * 1.15)


def test_an_outlier_under_the_headroom_is_not_cut() -> None:
    """Above 5x the median, but under the kept maximum's 15% headroom: drawn on scale, with
    no off-scale note (the chart once raised IndexError here and failed `shard train`)."""
    values = [1.0, 1.0, 1.0, 4.9, 5.2]
    assert _ceiling(values) is None
    records = [{"step": step, "step_s": v / 10} for step, v in enumerate(values, start=1)]
    step_time = training_figure(records, RANKS, title=TITLE).axes[3]
    assert len(step_time.lines[0].get_ydata()) == len(values)
    assert list(step_time.texts) == []
