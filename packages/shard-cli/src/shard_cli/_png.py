"""PNG files from the standard library: an encoder, a rasterizer, a 5x7 font, two charts.

Why not matplotlib: ``shard train`` must run wherever shard's packages run,
and a loss curve and a few bars need lines, rectangles and digits only. The
encoder writes 8-bit RGB, one IDAT chunk compressed with ``zlib``, every row
with filter type 0; any viewer reads it.
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Sequence

__all__ = ["Canvas", "encode_png", "training_chart"]

Color = tuple[int, int, int]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

WHITE: Color = (255, 255, 255)
BLACK: Color = (0, 0, 0)
GREY: Color = (200, 200, 200)
DARK: Color = (90, 90, 90)
PALETTE: tuple[Color, ...] = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40))

# Seven rows of five pixels per glyph, each row one hex byte (bit 4 is the left pixel).
# Upper-case letters are drawn as lower-case ones; unknown characters as "?".
_FONT: dict[str, str] = {
    "0": "0e11131519110e",
    "1": "040c040404040e",
    "2": "0e11010204081f",
    "3": "1f02040201110e",
    "4": "02060a121f0202",
    "5": "1f101e0101110e",
    "6": "0608101e11110e",
    "7": "1f010204080808",
    "8": "0e11110e11110e",
    "9": "0e11110f01020c",
    "a": "00000e010f110f",
    "b": "1010161911111e",
    "c": "00000e1010110e",
    "d": "01010d1311110f",
    "e": "00000e111f100e",
    "f": "0609081c080808",
    "g": "000f11110f010e",
    "h": "10101619111111",
    "i": "04000c0404040e",
    "j": "0200060202120c",
    "k": "10101214181412",
    "l": "0c04040404040e",
    "m": "00001a15151111",
    "n": "00001619111111",
    "o": "00000e1111110e",
    "p": "00001e111e1010",
    "q": "00000d130f0101",
    "r": "00001619101010",
    "s": "00000e100e011e",
    "t": "08081c08080906",
    "u": "0000111111130d",
    "v": "00001111110a04",
    "w": "0000111115150a",
    "x": "0000110a040a11",
    "y": "000011110f010e",
    "z": "00001f0204081f",
    ".": "00000000000c0c",
    ",": "000000000c0408",
    "-": "0000001f000000",
    "+": "0004041f040400",
    ":": "000c0c000c0c00",
    "/": "00010204081000",
    "(": "02040808080402",
    ")": "08040202020408",
    "%": "18190204081303",
    "_": "0000000000001f",
    "=": "00001f001f0000",
    " ": "00000000000000",
    "?": "0e110102040004",
}
_GLYPH_W, _GLYPH_H = 5, 7


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def encode_png(width: int, height: int, rgb: bytes) -> bytes:
    """A PNG of ``width`` x ``height`` 8-bit RGB pixels given row by row.

    Raises:
        ValueError: ``rgb`` does not hold ``width * height * 3`` bytes.
    """
    if width < 1 or height < 1 or len(rgb) != width * height * 3:
        raise ValueError(
            f"encode_png: {len(rgb)} bytes of pixels for a {width}x{height} RGB image, which "
            f"needs {max(width, 0) * max(height, 0) * 3}"
        )
    stride = width * 3
    raw = b"".join(b"\x00" + rgb[y * stride : (y + 1) * stride] for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        PNG_SIGNATURE
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(raw, 9))
        + _chunk(b"IEND", b"")
    )


class Canvas:
    """An RGB image in memory with the few drawing operations the charts need."""

    def __init__(self, width: int, height: int, background: Color = WHITE) -> None:
        self.width = width
        self.height = height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        """Paint one pixel; outside the image nothing happens."""
        if 0 <= x < self.width and 0 <= y < self.height:
            i = (y * self.width + x) * 3
            self.pixels[i : i + 3] = bytes(color)

    def get(self, x: int, y: int) -> Color:
        """The color of one pixel."""
        i = (y * self.width + x) * 3
        return (self.pixels[i], self.pixels[i + 1], self.pixels[i + 2])

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Fill the rectangle with corners (x0, y0) and (x1, y1), both included."""
        for y in range(max(0, min(y0, y1)), min(self.height, max(y0, y1) + 1)):
            for x in range(max(0, min(x0, x1)), min(self.width, max(x0, x1) + 1)):
                self.set(x, y, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, width: int = 1) -> None:
        """A straight line (Bresenham), ``width`` pixels thick."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for o in range(width):
                self.set(x0, y0 + o, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, text: str, color: Color = BLACK, scale: int = 1) -> int:
        """Draw ``text`` with its top-left corner at (x, y); return the x after it."""
        for ch in text:
            glyph = _FONT.get(ch.lower(), _FONT["?"])
            for row in range(_GLYPH_H):
                bits = int(glyph[2 * row : 2 * row + 2], 16)
                for col in range(_GLYPH_W):
                    if bits & (1 << (_GLYPH_W - 1 - col)):
                        self.rect(
                            x + col * scale,
                            y + row * scale,
                            x + (col + 1) * scale - 1,
                            y + (row + 1) * scale - 1,
                            color,
                        )
            x += (_GLYPH_W + 1) * scale
        return x

    @staticmethod
    def text_width(text: str, scale: int = 1) -> int:
        """Pixels ``text`` takes horizontally."""
        return len(text) * (_GLYPH_W + 1) * scale

    def png(self) -> bytes:
        """The image as PNG bytes."""
        return encode_png(self.width, self.height, bytes(self.pixels))


def _number(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def _axes(canvas: Canvas, box: tuple[int, int, int, int], low: float, high: float) -> None:
    """Frame, four horizontal grid lines and their values on the left."""
    left, top, right, bottom = box
    for i in range(5):
        y = bottom - round(i * (bottom - top) / 4)
        canvas.line(left, y, right, y, GREY)
        label = _number(low + (high - low) * i / 4)
        canvas.text(left - Canvas.text_width(label) - 4, y - 3, label, DARK)
    canvas.line(left, top, left, bottom, BLACK)
    canvas.line(left, bottom, right, bottom, BLACK)


def _loss_panel(
    canvas: Canvas, box: tuple[int, int, int, int], curve: Sequence[tuple[int, float]]
) -> None:
    left, top, right, bottom = box
    canvas.text(left, top - 14, "loss", BLACK)
    if not curve:
        return
    low = min(v for _, v in curve)
    high = max(v for _, v in curve)
    if high - low < 1e-9:
        low, high = low - 0.5, high + 0.5
    _axes(canvas, box, low, high)
    first, last = curve[0][0], curve[-1][0]
    span = max(1, last - first)

    def point(step: int, value: float) -> tuple[int, int]:
        x = left + round((step - first) * (right - left) / span)
        y = bottom - round((value - low) * (bottom - top) / (high - low))
        return x, y

    for (s0, v0), (s1, v1) in itertools.pairwise(curve):
        canvas.line(*point(s0, v0), *point(s1, v1), PALETTE[0], width=2)
    for step in (first, (first + last) // 2, last):
        label = str(step)
        x = point(step, low)[0] - Canvas.text_width(label) // 2
        canvas.text(x, bottom + 6, label, DARK)
    canvas.text(right - Canvas.text_width("step"), bottom + 18, "step", BLACK)


def _memory_panel(
    canvas: Canvas,
    box: tuple[int, int, int, int],
    ranks: Sequence[tuple[str, int, int, int, int]],
) -> None:
    left, top, right, bottom = box
    canvas.text(left, top - 14, "memory per rank (mib)", BLACK)
    if not ranks:
        return
    high = max(max(r[1:]) for r in ranks) / 2**20 or 1.0
    _axes(canvas, box, 0.0, high)
    group = (right - left) / len(ranks)
    bar = max(2, int(group / 6))
    for index, (label, *values) in enumerate(ranks):
        x = left + round(index * group + group / 2 - 2 * bar)
        for k, value in enumerate(values):
            height = round(value / 2**20 / high * (bottom - top))
            canvas.rect(x + k * bar, bottom - height, x + (k + 1) * bar - 2, bottom - 1, PALETTE[k])
        canvas.text(x, bottom + 6, label, DARK)
    legend_y = bottom + 18
    x = left
    for k, name in enumerate(("params", "grads", "adamw", "peak")):
        canvas.rect(x, legend_y, x + 6, legend_y + 6, PALETTE[k])
        x = canvas.text(x + 10, legend_y, name, DARK) + 8


def training_chart(
    curve: Sequence[tuple[int, float]],
    ranks: Sequence[tuple[str, int, int, int, int]],
    *,
    title: str,
    width: int = 900,
    height: int = 360,
) -> bytes:
    """A PNG: the loss per step on the left, per-rank memory bars on the right.

    ``curve`` is ``(step, loss)`` pairs; ``ranks`` is ``(label, params, grads,
    optimizer state, peak)`` in bytes.
    """
    canvas = Canvas(width, height)
    canvas.text(10, 8, title, BLACK, scale=2)
    split = int(width * 0.6)
    _loss_panel(canvas, (70, 60, split - 30, height - 50), curve)
    _memory_panel(canvas, (split + 60, 60, width - 20, height - 50), ranks)
    return canvas.png()
