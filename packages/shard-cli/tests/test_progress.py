"""The progress line and the numbers in it."""

from __future__ import annotations

import io

from shard_cli._format import format_bytes, format_duration, format_rate
from shard_cli._progress import Progress


def test_formats() -> None:
    """Durations as m:ss or h:mm:ss, rates with k/M, sizes in binary units."""
    assert format_duration(75.2) == "1:15"
    assert format_duration(3725) == "1:02:05"
    assert format_rate(999) == "999"
    assert format_rate(12345.6) == "12.3k"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**30) == "3.0 GiB"
    assert format_bytes(100) == "100 B"


def test_line_shows_step_bar_loss_rate_and_eta() -> None:
    """Half way through, the bar is half full and the ETA equals the time spent."""
    progress = Progress(io.StringIO(), first=1, last=10, tty=False)
    assert progress.line(5, 2.5, 12345.0, 10.0) == (
        "step  5/10 [############............] loss 2.500  12.3k tok/s  ETA 0:10"
    )


def test_without_a_terminal_lines_are_printed_every_tenth() -> None:
    """Off a terminal: the first, every ``every``-th and the last step, one line each."""
    out = io.StringIO()
    progress = Progress(out, first=1, last=20, tty=False)
    for step in range(1, 21):
        progress.update(step, 1.0, 100.0)
    steps = [line.split("/")[0].split()[-1] for line in out.getvalue().splitlines()]
    assert steps == ["1", "2", "4", "6", "8", "10", "12", "14", "16", "18", "20"]


def test_on_a_terminal_the_line_is_redrawn_in_place() -> None:
    """On a terminal every update starts with a carriage return and close ends the line."""
    out = io.StringIO()
    progress = Progress(out, first=1, last=2, tty=True)
    progress.update(1, 1.0, 100.0)
    progress.update(2, 0.5, 100.0)
    progress.close()
    text = out.getvalue()
    assert text.count("\r") == 2
    assert text.endswith("\n")
    assert text.count("\n") == 1
