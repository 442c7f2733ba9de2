"""``training.png``: a run's loss, throughput, step time and per-rank memory in one picture.

matplotlib draws four panels (``PANELS`` and the memory bars) from the records of
``metrics.jsonl`` and the per-rank memory of ``summary.json``. See [Note: drawing with
matplotlib].
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "CHART_SIZE",
    "MEMORY_KINDS",
    "PANELS",
    "Panel",
    "RankMemory",
    "memory_unit",
    "training_chart",
    "training_figure",
]

# [Note: drawing with matplotlib]
# matplotlib (a dependency of shard-cli) draws a 1200x750 image. It is imported
# inside the functions that use it, never at module level: ``import shard_cli``
# and the start of ``shard train`` do not pay for it, and a run that never
# reaches its plot never loads it. Figures are built from
# ``matplotlib.figure.Figure`` with the Agg canvas, not ``pyplot``: no display,
# no global figure registry, no backend switch that could leak into a user's
# process.

# (label, params, grads, optimizer state, peak), in bytes: one rank's bars.
RankMemory = tuple[str, int, int, int, int]

MEMORY_KINDS: tuple[str, ...] = ("params", "grads", "AdamW state", "peak")

CHART_SIZE = (1200, 750)  # pixels: 12 x 7.5 inches at 100 dpi


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
    ceiling = max(kept) * 1.15
    # An outlier just above 5x the median can still fit under the headroom: nothing is cut.
    return ceiling if max(values) > ceiling else None


def _off_scale_note(points: Sequence[tuple[int, float]], ceiling: float, unit: str) -> str:
    """Which points lie above ``ceiling``: "step 1: 580 ms, off scale"."""
    above = [(s, v) for s, v in points if v > ceiling]
    first, value = above[0]
    more = f" (+{len(above) - 1} more)" if len(above) > 1 else ""
    return f"step {first}: {_number(value)} {unit}{more}, off scale"


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


def _line(axes: Axes, points: Sequence[tuple[int, float]], panel: Panel) -> None:
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


def _memory(axes: Axes, ranks: Sequence[RankMemory]) -> None:
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


def training_figure(
    records: Sequence[Mapping[str, Any]], ranks: Sequence[RankMemory], *, title: str
) -> Figure:
    """The chart as a matplotlib figure (Agg canvas); see [Note: drawing with matplotlib].

    ``records`` are ``metrics.jsonl``'s lines (``step`` and the ``PANELS``' keys);
    ``ranks`` one ``RankMemory`` per rank.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    width, height = CHART_SIZE
    figure = Figure(figsize=(width / 100, height / 100), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(title, fontsize=14)
    (loss, memory), (throughput, step_time) = figure.subplots(2, 2)
    for axes, panel in zip((loss, throughput, step_time), PANELS, strict=True):
        _line(axes, _series(records, panel), panel)
    _memory(memory, ranks)
    return figure


def training_chart(
    records: Sequence[Mapping[str, Any]], ranks: Sequence[RankMemory], *, title: str
) -> bytes:
    """``training.png``'s bytes: :func:`training_figure` as a PNG of ``CHART_SIZE`` pixels."""
    buffer = io.BytesIO()
    training_figure(records, ranks, title=title).savefig(
        buffer, format="png", dpi=100, metadata={"Software": None}
    )
    return buffer.getvalue()
