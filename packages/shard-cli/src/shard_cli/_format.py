"""Sizes, durations and rates as ``shard``'s commands print them."""

from __future__ import annotations

__all__ = ["format_bytes", "format_duration", "format_rate"]


def format_bytes(nbytes: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; ``3 * 2**30`` -> ``"3.0 GiB"``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_duration(seconds: float) -> str:
    """``75.2`` -> ``"1:15"``; ``3725`` -> ``"1:02:05"``."""
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_rate(per_second: float) -> str:
    """``12345.6`` -> ``"12.3k"``; ``999`` -> ``"999"``."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if per_second >= limit:
            return f"{per_second / limit:.1f}{suffix}"
    return f"{per_second:.0f}"
