"""PNG files from the standard library: an encoder, a rasterizer and a bitmap font.

Why: ``shard train`` writes ``training.png`` wherever shard's packages run,
matplotlib installed or not (see ``_plot.py``, which draws with this module
when matplotlib is absent). A chart needs lines, rectangles and legible
labels only. The encoder writes 8-bit RGB, one IDAT chunk compressed with
``zlib``, every row with filter type 0; any viewer reads it.
"""

from __future__ import annotations

import struct
import zlib

__all__ = ["FONT", "Canvas", "encode_png", "missing_glyphs"]

Color = tuple[int, int, int]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

WHITE: Color = (255, 255, 255)
BLACK: Color = (0, 0, 0)
GREY: Color = (200, 200, 200)
DARK: Color = (90, 90, 90)
PALETTE: tuple[Color, ...] = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40))

# [Note: the bitmap font]
# Each glyph is 5 pixels wide and 9 tall: rows 0-6 hold capitals, digits and
# ascenders (row 6 is the baseline row), lower case sits on rows 2-6, and rows
# 7-8 hold the descenders of g, j, p, q, y and the tails of "," and ";". A
# glyph advances 6 pixels. Capitals and lower case are distinct, so "MiB" and
# "grads" print as written. The art below is the font itself: each block names
# its characters, then gives the 9 rows of each, "#" for ink, one space apart.
# A character the font lacks prints as "?".
GLYPH_WIDTH = 5
GLYPH_HEIGHT = 9
ADVANCE = GLYPH_WIDTH + 1
_FONT_ART: tuple[tuple[str, ...], ...] = (
    (
        "ABCDEFGHIJKLMN",
        ".###. ####. .###. ####. ##### ##### .###. #...# .###. ..### #...# #.... #...# #...#",
        "#...# #...# #...# #...# #.... #.... #...# #...# ..#.. ...#. #..#. #.... ##.## #...#",
        "#...# #...# #.... #...# #.... #.... #.... #...# ..#.. ...#. #.#.. #.... #.#.# ##..#",
        "##### ####. #.... #...# ####. ####. #.### ##### ..#.. ...#. ##... #.... #.#.# #.#.#",
        "#...# #...# #.... #...# #.... #.... #...# #...# ..#.. ...#. #.#.. #.... #...# #..##",
        "#...# #...# #...# #...# #.... #.... #...# #...# ..#.. #..#. #..#. #.... #...# #...#",
        "#...# ####. .###. ####. ##### #.... .#### #...# .###. .##.. #...# ##### #...# #...#",
        "..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... .....",
        "..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... .....",
    ),
    (
        "OPQRSTUVWXYZab",
        ".###. ####. .###. ####. .#### ##### #...# #...# #...# #...# #...# ##### ..... #....",
        "#...# #...# #...# #...# #.... ..#.. #...# #...# #...# #...# #...# ....# ..... #....",
        "#...# #...# #...# #...# #.... ..#.. #...# #...# #...# .#.#. .#.#. ...#. .###. #.##.",
        "#...# ####. #...# ####. .###. ..#.. #...# #...# #.#.# ..#.. ..#.. ..#.. ....# ##..#",
        "#...# #.... #.#.# #.#.. ....# ..#.. #...# #...# #.#.# .#.#. ..#.. .#... .#### #...#",
        "#...# #.... #..#. #..#. ....# ..#.. #...# .#.#. #.#.# #...# ..#.. #.... #...# #...#",
        ".###. #.... .##.# #...# ####. ..#.. .###. ..#.. .#.#. #...# ..#.. ##### .#### ####.",
        "..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... .....",
        "..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... .....",
    ),
    (
        "cdefghijklmnop",
        "..... ....# ..... ..##. ..... #.... ..#.. ...#. #.... .##.. ..... ..... ..... .....",
        "..... ....# ..... .#..# ..... #.... ..... ..... #.... ..#.. ..... ..... ..... .....",
        ".###. .##.# .###. .#... .#### #.##. .##.. ..##. #..#. ..#.. ##.#. #.##. .###. ####.",
        "#.... #..## #...# ###.. #...# ##..# ..#.. ...#. #.#.. ..#.. #.#.# ##..# #...# #...#",
        "#.... #...# ##### .#... #...# #...# ..#.. ...#. ##... ..#.. #.#.# #...# #...# #...#",
        "#...# #...# #.... .#... #...# #...# ..#.. ...#. #.#.. ..#.. #.#.# #...# #...# #...#",
        ".###. .#### .###. .#... .#### #...# .###. ...#. #..#. .###. #...# #...# .###. ####.",
        "..... ..... ..... ..... ....# ..... ..... #..#. ..... ..... ..... ..... ..... #....",
        "..... ..... ..... ..... .###. ..... ..... .##.. ..... ..... ..... ..... ..... #....",
    ),
    (
        "qrstuvwxyz0123",
        "..... ..... ..... .#... ..... ..... ..... ..... ..... ..... .###. ..#.. .###. #####",
        "..... ..... ..... .#... ..... ..... ..... ..... ..... ..... #...# .##.. #...# ...#.",
        ".#### #.##. .#### ###.. #...# #...# #...# #...# #...# ##### #..## ..#.. ....# ..#..",
        "#...# ##..# #.... .#... #...# #...# #...# .#.#. #...# ...#. #.#.# ..#.. ...#. ...#.",
        "#...# #.... .###. .#... #...# #...# #.#.# ..#.. #...# ..#.. ##..# ..#.. ..#.. ....#",
        "#...# #.... ....# .#..# #..## .#.#. #.#.# .#.#. #...# .#... #...# ..#.. .#... #...#",
        ".#### #.... ####. ..##. .##.# ..#.. .#.#. #...# .#### ##### .###. .###. ##### .###.",
        "....# ..... ..... ..... ..... ..... ..... ..... ....# ..... ..... ..... ..... .....",
        "....# ..... ..... ..... ..... ..... ..... ..... .###. ..... ..... ..... ..... .....",
    ),
    (
        "456789.,;:-+=_",
        "...#. ##### ..##. ##### .###. .###. ..... ..... ..... ..... ..... ..... ..... .....",
        "..##. #.... .#... ....# #...# #...# ..... ..... ..... ..... ..... ..#.. ..... .....",
        ".#.#. ####. #.... ...#. #...# #...# ..... ..... .##.. .##.. ..... ..#.. ##### .....",
        "#..#. ....# ####. ..#.. .###. .#### ..... ..... .##.. .##.. ##### ##### ..... .....",
        "##### ....# #...# .#... #...# ....# ..... ..... ..... ..... ..... ..#.. ##### .....",
        "...#. #...# #...# .#... #...# ...#. .##.. .##.. .##.. .##.. ..... ..#.. ..... .....",
        "...#. .###. .###. .#... .###. .##.. .##.. .##.. .##.. .##.. ..... ..... ..... .....",
        "..... ..... ..... ..... ..... ..... ..... ..#.. ..#.. ..... ..... ..... ..... #####",
        "..... ..... ..... ..... ..... ..... ..... .#... .#... ..... ..... ..... ..... .....",
    ),
    (
        "/()[]%?!'\"*#<>",
        "....# ...#. .#... .###. .###. ##... .###. ..#.. ..#.. .#.#. ..... ..... ..... .....",
        "....# ..#.. ..#.. .#... ...#. ##..# #...# ..#.. ..#.. .#.#. ..#.. .#.#. ...#. .#...",
        "...#. .#... ...#. .#... ...#. ...#. ....# ..#.. .#... ..... #.#.# ##### ..#.. ..#..",
        "..#.. .#... ...#. .#... ...#. ..#.. ...#. ..#.. ..... ..... .###. .#.#. .#... ...#.",
        ".#... .#... ...#. .#... ...#. .#... ..#.. ..#.. ..... ..... #.#.# ##### ..#.. ..#..",
        "#.... ..#.. ..#.. .#... ...#. #..## ..... ..... ..... ..... ..#.. .#.#. ...#. .#...",
        "#.... ...#. .#... .###. .###. ...## ..#.. ..#.. ..... ..... ..... ..... ..... .....",
        "..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... .....",
        "..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... .....",
    ),
    (
        "|~@&$^\\`{} ",
        "..#.. ..... .###. .##.. ..#.. ..#.. #.... .#... ..##. .##.. .....",
        "..#.. ..... #...# #..#. .#### .#.#. #.... ..#.. .#... ...#. .....",
        "..#.. ..... #.### #.#.. #.#.. #...# .#... ..... .#... ...#. .....",
        "..#.. .##.# #.#.# .#... .###. ..... ..#.. ..... ##... ...## .....",
        "..#.. #.##. #.### #.#.# ..#.# ..... ...#. ..... .#... ...#. .....",
        "..#.. ..... #.... #..#. ####. ..... ....# ..... .#... ...#. .....",
        "..#.. ..... .#### .##.# ..#.. ..... ....# ..... ..##. .##.. .....",
        "..#.. ..... ..... ..... ..... ..... ..... ..... ..... ..... .....",
        "..#.. ..... ..... ..... ..... ..... ..... ..... ..... ..... .....",
    ),
)


def _parse_font(art: tuple[tuple[str, ...], ...]) -> dict[str, tuple[str, ...]]:
    """Glyph rows by character, from the blocks of ``_FONT_ART``."""
    font: dict[str, tuple[str, ...]] = {}
    for chars, *rows in art:
        assert len(rows) == GLYPH_HEIGHT, chars
        for index, char in enumerate(chars):
            start = index * ADVANCE
            font[char] = tuple(row[start : start + GLYPH_WIDTH] for row in rows)
    return font


FONT: dict[str, tuple[str, ...]] = _parse_font(_FONT_ART)


def missing_glyphs(text: str) -> set[str]:
    """The characters of ``text`` the font lacks (they would print as "?")."""
    return {char for char in text if char not in FONT}


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
        """Draw ``text`` with its cell's top-left corner at (x, y); return the x after it.

        See [Note: the bitmap font]: the cell is ``GLYPH_HEIGHT * scale`` pixels
        tall, descenders included.
        """
        for char in text:
            for row, bits in enumerate(FONT.get(char, FONT["?"])):
                for col, ink in enumerate(bits):
                    if ink == "#":
                        self.rect(
                            x + col * scale,
                            y + row * scale,
                            x + (col + 1) * scale - 1,
                            y + (row + 1) * scale - 1,
                            color,
                        )
            x += ADVANCE * scale
        return x

    @staticmethod
    def text_width(text: str, scale: int = 1) -> int:
        """Pixels ``text`` takes horizontally (the last glyph's spacing column included)."""
        return len(text) * ADVANCE * scale

    def png(self) -> bytes:
        """The image as PNG bytes."""
        return encode_png(self.width, self.height, bytes(self.pixels))
