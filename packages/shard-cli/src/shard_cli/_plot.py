"""``training.png``: a run's loss, throughput, step time and per-rank memory in one picture.

Both renderers draw the same four panels with the same titles and units
(``PANELS``), from the records of ``metrics.jsonl`` and the per-rank memory of
``summary.json``. See [Note: two renderers].
"""

from __future__ import annotations

import io
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from shard_cli._png import BLACK, DARK, GREY, PALETTE, WHITE, Canvas

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = [
    "MEMORY_KINDS",
    "PANELS",
    "Panel",
    "RankMemory",
    "Renderer",
    "available_renderer",
    "builtin_chart",
    "matplotlib_chart",
    "memory_unit",
    "training_chart",
]

# [Note: two renderers]
# matplotlib draws training.png when it imports (shard-cli's ``plot`` extra):
# real fonts, rotated axis titles, a 1200x750 image. Without it, shard's own
# PNG writer (_png.py) draws the same panels at 960x600 with its bitmap font,
# so ``shard train`` never needs matplotlib. matplotlib is imported inside the
# functions that use it, never at module level: ``import shard_cli`` and the
# start of ``shard train`` do not pay for it, and a run that never reaches its
# plot never loads it. Figures are built from ``matplotlib.figure.Figure`` with
# the Agg canvas, not ``pyplot``: no display, no global figure registry, no
# backend switch that could leak into a user's process.

Renderer = Literal["matplotlib", "builtin"]

# (label, params, grads, optimizer state, peak), in bytes: one rank's bars.
RankMemory = tuple[str, int, int, int, int]

MEMORY_KINDS: tuple[str, ...] = ("params", "grads", "AdamW state", "peak")

MATPLOTLIB_SIZE = (1200, 750)  # pixels: 12 x 7.5 inches at 100 dpi
BUILTIN_SIZE = (960, 600)


@dataclass(frozen=True, slots=True)
class Panel:
    """One line panel of the chart.

    Attributes:
        title: What the panel shows.
        ylabel: The y axis's quantity and unit.
        key: The ``metrics.jsonl`` field plotted against ``step``.
        scale: Factor from the field's unit to the axis's (seconds to ms: 1000).
        unit: The unit a value is printed in, when one is printed alone.
    """

    title: str
    ylabel: str
    key: str
    scale: float = 1.0
    unit: str = ""


PANELS: tuple[Panel, ...] = (
    Panel("Training loss", "cross-entropy (nats/token)", "loss"),
    Panel("Throughput, all ranks", "tokens/s (mean since start)", "tokens_per_s"),
    Panel("Step time, rank 0", "ms per step", "step_s", 1000.0, "ms"),
)
MEMORY_TITLE = "Memory per rank"
STEP_LABEL = "step"


def memory_unit(largest: float) -> tuple[str, int]:
    """The binary unit (name, bytes) in which ``largest`` bytes reads as at least 1."""
    for name, size in (("GiB", 2**30), ("MiB", 2**20)):
        if largest >= size:
            return name, size
    return "KiB", 2**10


def _series(records: Sequence[Mapping[str, Any]], panel: Panel) -> list[tuple[int, float]]:
    """``(step, value)`` for the records that hold ``panel.key`` as a finite number."""
    return [
        (int(r["step"]), float(r[panel.key]) * panel.scale)
        for r in records
        if isinstance(r.get(panel.key), int | float) and math.isfinite(r[panel.key])
    ]


def _ceiling(values: Sequence[float]) -> float | None:
    """A y limit that leaves warm-up outliers off scale, or ``None`` when there are none.

    The first steps of a run are slow (allocation, gloo connections, kernel
    selection); at five times the median they would flatten every later
    step's variation into one line.
    """
    if len(values) < 4:
        return None
    median = sorted(values)[len(values) // 2]
    kept = [v for v in values if v <= 5 * median]
    if len(kept) == len(values) or median <= 0:
        return None
    return max(kept) * 1.15


def _off_scale_note(points: Sequence[tuple[int, float]], ceiling: float, unit: str) -> str:
    """Which points lie above ``ceiling``: "step 1: 580 ms, off scale"."""
    above = [(s, v) for s, v in points if v > ceiling]
    first, value = above[0]
    more = f" (+{len(above) - 1} more)" if len(above) > 1 else ""
    return f"step {first}: {_number(value)} {unit}{more}, off scale"


def available_renderer() -> Renderer:
    """``"matplotlib"`` when its Agg backend imports, else ``"builtin"``."""
    try:
        import matplotlib.backends.backend_agg  # noqa: F401
    except ImportError:
        return "builtin"
    return "matplotlib"


def training_chart(
    records: Sequence[Mapping[str, Any]],
    ranks: Sequence[RankMemory],
    *,
    title: str,
    renderer: Renderer | None = None,
) -> bytes:
    """``training.png``'s bytes, drawn by ``renderer`` (default: the best one installed).

    ``records`` are ``metrics.jsonl``'s lines (``step`` and the ``PANELS``' keys);
    ``ranks`` one ``RankMemory`` per rank.
    """
    chosen = renderer or available_renderer()
    draw = matplotlib_chart if chosen == "matplotlib" else builtin_chart
    return draw(records, ranks, title=title)


# ------------------------------------------------------------------ matplotlib


def _matplotlib_line(axes: Axes, points: Sequence[tuple[int, float]], panel: Panel) -> None:
    from matplotlib.ticker import MaxNLocator

    axes.set_title(panel.title)
    axes.set_xlabel(STEP_LABEL)
    axes.set_ylabel(panel.ylabel)
    axes.grid(True, color="#dddddd")
    if not points:
        axes.text(0.5, 0.5, "no data", ha="center", va="center", transform=axes.transAxes)
        return
    steps = [s for s, _ in points]
    values = [v for _, v in points]
    axes.plot(steps, values, color="#1f77b4", marker="o" if len(points) <= 30 else None, ms=3)
    ceiling = _ceiling(values)
    if ceiling is not None:
        axes.set_ylim(0, ceiling)
        note = _off_scale_note(points, ceiling, panel.unit)
        axes.text(0.98, 0.96, note, ha="right", va="top", transform=axes.transAxes, color="#555555")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    if panel.key == "loss":
        axes.annotate(
            f"{values[0]:.3f}", (steps[0], values[0]), textcoords="offset points", xytext=(6, 0)
        )
        axes.annotate(
            f"{values[-1]:.3f}",
            (steps[-1], values[-1]),
            textcoords="offset points",
            xytext=(-6, 8),
            ha="right",
        )


def _matplotlib_memory(axes: Axes, ranks: Sequence[RankMemory]) -> None:
    largest = max((max(r[1:]) for r in ranks), default=0)
    unit, size = memory_unit(largest)
    axes.set_title(MEMORY_TITLE)
    axes.set_ylabel(unit)
    axes.grid(True, axis="y", color="#dddddd")
    axes.set_axisbelow(True)
    if not ranks:
        axes.text(0.5, 0.5, "no data", ha="center", va="center", transform=axes.transAxes)
        return
    width = 0.8 / len(MEMORY_KINDS)
    for k, kind in enumerate(MEMORY_KINDS):
        xs = [i + (k - (len(MEMORY_KINDS) - 1) / 2) * width for i in range(len(ranks))]
        bars = axes.bar(xs, [r[1:][k] / size for r in ranks], width, label=kind)
        if len(ranks) <= 4:
            axes.bar_label(bars, fmt="%.2f", fontsize=8, padding=2)
    axes.set_xticks(range(len(ranks)), [r[0] for r in ranks])
    axes.set_ylim(0, largest / size * 1.3 or 1.0)
    axes.legend(loc="upper left", fontsize=9, ncols=len(MEMORY_KINDS))


def matplotlib_chart(
    records: Sequence[Mapping[str, Any]], ranks: Sequence[RankMemory], *, title: str
) -> bytes:
    """The chart drawn by matplotlib (Agg, no display); see [Note: two renderers].

    Raises:
        ImportError: matplotlib is not installed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    width, height = MATPLOTLIB_SIZE
    figure = Figure(figsize=(width / 100, height / 100), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(title, fontsize=14)
    (loss, memory), (throughput, step_time) = figure.subplots(2, 2)
    for axes, panel in zip((loss, throughput, step_time), PANELS, strict=True):
        _matplotlib_line(axes, _series(records, panel), panel)
    _matplotlib_memory(memory, ranks)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, metadata={"Software": None})
    return buffer.getvalue()


# ------------------------------------------------------------------ builtin


def _number(value: float) -> str:
    """A tick label of at most about six characters."""
    size = abs(value)
    if value == 0:
        return "0"
    if size >= 1e6:
        return f"{value / 1e6:.1f}M"
    if size >= 1e4:
        return f"{value / 1e3:.0f}k"
    if size >= 100:
        return f"{value:.0f}"
    if size >= 1:
        return f"{value:.2f}".rstrip("0").rstrip(".")
    return f"{value:.3f}"


def _nice_range(low: float, high: float) -> tuple[float, float, int]:
    """``[low, high]`` widened to 3-6 equal steps of 1, 2, 2.5 or 5 x 10^k, and their count.

    Round tick values ("2.5", "3", "3.5") read at a glance; the data's own
    extremes as ticks ("4815", "7482") do not.
    """
    if high <= low:
        high = low + (abs(low) or 1.0)
    magnitude = 10 ** math.floor(math.log10((high - low) / 6))
    for step in (f * magnitude * 10**k for k in range(3) for f in (1.0, 2.0, 2.5, 5.0)):
        start = math.floor(low / step) * step
        intervals = max(1, math.ceil((high - start) / step - 1e-9))
        if intervals <= 6:
            return start, start + intervals * step, intervals
    raise AssertionError("unreachable: a step of 100 x magnitude spans the range in one")


Box = tuple[int, int, int, int]  # left, top, right, bottom: the plotting area in pixels


def _frame(
    canvas: Canvas, box: Box, title: str, low: float, high: float, intervals: int = 4
) -> None:
    """The panel's title, frame, horizontal grid lines and their values on the left."""
    left, top, right, bottom = box
    canvas.text(left, top - 16, title, BLACK)
    for i in range(intervals + 1):
        y = bottom - round(i * (bottom - top) / intervals)
        canvas.line(left, y, right, y, GREY)
        label = _number(low + (high - low) * i / intervals)
        canvas.text(left - Canvas.text_width(label) - 4, y - 4, label, DARK)
    canvas.line(left, top, left, bottom, BLACK)
    canvas.line(left, bottom, right, bottom, BLACK)


def _no_data(canvas: Canvas, box: Box) -> None:
    """ "no data" in the middle of an empty panel, on white so grid lines do not cross it."""
    left, top, right, bottom = box
    x = (left + right - Canvas.text_width("no data")) // 2
    y = (top + bottom) // 2 - 4
    canvas.rect(x - 4, y - 3, x + Canvas.text_width("no data") + 2, y + 11, WHITE)
    canvas.text(x, y, "no data", DARK)


def _builtin_line(
    canvas: Canvas, box: Box, points: Sequence[tuple[int, float]], panel: Panel
) -> None:
    left, top, right, bottom = box
    title = f"{panel.title}: {panel.ylabel}"
    if not points:
        _frame(canvas, box, title, 0.0, 1.0)
        _no_data(canvas, box)
        return
    values = [v for _, v in points]
    ceiling = _ceiling(values)
    if ceiling is None:
        low, high, intervals = _nice_range(min(values), max(values))
        _frame(canvas, box, title, low, high, intervals)
    else:
        low, high, intervals = _nice_range(0.0, ceiling)
        _frame(canvas, box, title, low, high, intervals)
        note = _off_scale_note(points, ceiling, panel.unit)
        canvas.rect(right - Canvas.text_width(note) - 8, top + 2, right - 2, top + 14, WHITE)
        canvas.text(right - Canvas.text_width(note) - 4, top + 4, note, DARK)
    first, last = points[0][0], points[-1][0]
    span = max(1, last - first)

    def at(step: int, value: float) -> tuple[int, int]:
        x = left + round((step - first) * (right - left) / span)
        y = bottom - round((min(value, high) - low) * (bottom - top) / (high - low))
        return x, y

    for (s0, v0), (s1, v1) in itertools.pairwise(points):
        canvas.line(*at(s0, v0), *at(s1, v1), PALETTE[0], width=2)
    if len(points) == 1:
        x, y = at(*points[0])
        canvas.rect(x - 2, y - 2, x + 2, y + 2, PALETTE[0])
    for step in sorted({first, (first + last) // 2, last}):
        label = str(step)
        x = at(step, low)[0] - Canvas.text_width(label) // 2
        canvas.text(x, bottom + 5, label, DARK)
    canvas.text(right - Canvas.text_width(STEP_LABEL), bottom + 18, STEP_LABEL, BLACK)


def _builtin_memory(canvas: Canvas, box: Box, ranks: Sequence[RankMemory]) -> None:
    left, top, right, bottom = box
    largest = max((max(r[1:]) for r in ranks), default=0)
    unit, size = memory_unit(largest)
    _, high, intervals = _nice_range(0.0, largest / size * 1.05 or 1.0)
    _frame(canvas, box, f"{MEMORY_TITLE}: {unit}", 0.0, high, intervals)
    if not ranks:
        _no_data(canvas, box)
        return
    group = (right - left) / len(ranks)
    bar = max(2, int(group / (len(MEMORY_KINDS) + 2)))
    for index, (label, *values) in enumerate(ranks):
        x = left + round(index * group + group / 2 - len(MEMORY_KINDS) * bar / 2)
        for k, value in enumerate(values):
            height = round(value / size / high * (bottom - top))
            canvas.rect(x + k * bar, bottom - height, x + (k + 1) * bar - 2, bottom - 1, PALETTE[k])
        centre = left + round(index * group + group / 2)
        canvas.text(centre - Canvas.text_width(label) // 2, bottom + 5, label, DARK)
    x = left
    for k, name in enumerate(MEMORY_KINDS):
        canvas.rect(x, bottom + 20, x + 7, bottom + 27, PALETTE[k])
        x = canvas.text(x + 11, bottom + 19, name, DARK) + 10


def builtin_chart(
    records: Sequence[Mapping[str, Any]], ranks: Sequence[RankMemory], *, title: str
) -> bytes:
    """The chart drawn by shard's own PNG writer; see [Note: two renderers]."""
    width, height = BUILTIN_SIZE
    canvas = Canvas(width, height)
    canvas.text(14, 10, title, BLACK, scale=2)
    column = width // 2
    row = (height - 50) // 2
    boxes: list[Box] = [
        (70 + c * column, 80 + r * row, column - 30 + c * column, 50 + (r + 1) * row - 50)
        for r in range(2)
        for c in range(2)
    ]
    loss_box, memory_box, throughput_box, time_box = boxes
    for box, panel in zip((loss_box, throughput_box, time_box), PANELS, strict=True):
        _builtin_line(canvas, box, _series(records, panel), panel)
    _builtin_memory(canvas, memory_box, ranks)
    return canvas.png()
