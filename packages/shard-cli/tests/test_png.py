"""The PNG writer: valid files (signature, IHDR, CRCs, pixel rows), drawing and the font."""

from __future__ import annotations

import string
import struct
import zlib

import pytest

from shard_cli._png import (
    ADVANCE,
    BLACK,
    FONT,
    GLYPH_HEIGHT,
    GLYPH_WIDTH,
    WHITE,
    Canvas,
    encode_png,
    missing_glyphs,
)


def read_png(data: bytes) -> tuple[int, int, bytes]:
    """(width, height, RGB pixels) of an 8-bit RGB PNG, checking every CRC and row filter."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks.append((kind, body))
        pos += 12 + length
    assert [k for k, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    width, height, depth, color, compression, filtering, interlace = struct.unpack(
        ">IIBBBBB", chunks[0][1]
    )
    assert (depth, color, compression, filtering, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(chunks[1][1])
    assert len(raw) == height * (1 + 3 * width)
    rows = [raw[y * (1 + 3 * width) : (y + 1) * (1 + 3 * width)] for y in range(height)]
    assert {row[0] for row in rows} == {0}
    return width, height, b"".join(row[1:] for row in rows)


def test_encode_png_round_trips_pixels() -> None:
    """A 3x2 image decodes to exactly the pixels given, with valid chunks and CRCs."""
    pixels = bytes(range(18))
    assert read_png(encode_png(3, 2, pixels)) == (3, 2, pixels)


def test_encode_png_rejects_a_wrong_pixel_count() -> None:
    """Too few bytes for the size is an error that says how many are needed."""
    with pytest.raises(ValueError, match=r"17 bytes of pixels for a 3x2 RGB image, which needs 18"):
        encode_png(3, 2, bytes(17))


def test_canvas_draws_lines_rectangles_and_text() -> None:
    """A line's endpoints, a rectangle's corners and a glyph's pixels are painted."""
    canvas = Canvas(40, 20)
    canvas.line(0, 0, 9, 9, BLACK)
    assert canvas.get(0, 0) == BLACK
    assert canvas.get(9, 9) == BLACK
    assert canvas.get(9, 0) == WHITE
    canvas.rect(20, 2, 22, 4, (1, 2, 3))
    assert canvas.get(20, 2) == (1, 2, 3)
    assert canvas.get(22, 4) == (1, 2, 3)
    assert canvas.get(23, 4) == WHITE
    end = canvas.text(10, 10, "1", BLACK)
    assert end == 16
    # "1": rows 040c040404040e; the top row has one pixel, in column 2.
    assert [canvas.get(10 + c, 10) for c in range(5)] == [WHITE, WHITE, BLACK, WHITE, WHITE]
    assert [canvas.get(10 + c, 16) for c in range(5)] == [WHITE, BLACK, BLACK, BLACK, WHITE]


def read_text(canvas: Canvas, x: int, y: int, length: int) -> str:
    """The ``length`` characters drawn at (x, y), read back by matching each cell to the font."""
    by_pixels = {pixels: char for char, pixels in FONT.items()}
    chars = []
    for index in range(length):
        cell = tuple(
            "".join(
                "#" if canvas.get(x + index * ADVANCE + col, y + row) != WHITE else "."
                for col in range(GLYPH_WIDTH)
            )
            for row in range(GLYPH_HEIGHT)
        )
        chars.append(by_pixels.get(cell, "\ufffd"))
    return "".join(chars)


def test_font_glyphs_are_well_formed_and_distinct() -> None:
    """Every glyph is 9 rows of 5 pixels, and no two characters share a bitmap (none misreads)."""
    for char, rows in FONT.items():
        assert len(rows) == GLYPH_HEIGHT, char
        assert all(len(row) == GLYPH_WIDTH and set(row) <= {".", "#"} for row in rows), char
    bitmaps = list(FONT.values())
    assert len(set(bitmaps)) == len(bitmaps)


def test_font_covers_printable_ascii() -> None:
    """Every printable ASCII character has a glyph: labels, model names and paths print."""
    assert missing_glyphs(string.ascii_letters + string.digits + string.punctuation + " ") == set()
    assert missing_glyphs("\u00b5\u00d7") == {"\u00b5", "\u00d7"}  # micro, times


def test_capitals_differ_from_lower_case() -> None:
    """Upper case is drawn as upper case: "MiB" is not "mib"."""
    for upper, lower in zip(string.ascii_uppercase, string.ascii_lowercase, strict=True):
        assert FONT[upper] != FONT[lower], upper


def test_descenders_go_below_the_baseline() -> None:
    """g, j, p, q, y, the tails of "," ";", "_" and "|" use rows 7-8; nothing else does."""
    below = {char for char, rows in FONT.items() if "#" in rows[7] + rows[8]}
    assert below == {"g", "j", "p", "q", "y", ",", ";", "_", "|"}


def test_text_round_trips_and_advances_six_pixels_a_character() -> None:
    """Labels read back as written (upper case and descenders intact); each glyph takes 6 pixels."""
    canvas = Canvas(200, 12)
    label = "grads (MiB), AdamW: 1.5k"
    end = canvas.text(3, 1, label)
    assert end == 3 + len(label) * ADVANCE == 3 + Canvas.text_width(label)
    assert read_text(canvas, 3, 1, len(label)) == label


def test_unknown_characters_print_as_a_question_mark() -> None:
    """A character outside the font is drawn as "?", never skipped (widths stay predictable)."""
    canvas = Canvas(20, 12)
    assert canvas.text(0, 0, "µ") == ADVANCE
    assert read_text(canvas, 0, 0, 1) == "?"


def test_scaled_text_is_each_pixel_a_square() -> None:
    """At scale 2 a glyph pixel is a 2x2 block and the advance doubles."""
    canvas = Canvas(30, 20)
    assert canvas.text(0, 0, "1", scale=2) == 2 * ADVANCE
    # "1" row 0 is "..#..": columns 4 and 5 at scale 2.
    assert [canvas.get(c, 0) == BLACK for c in range(10)] == [c in (4, 5) for c in range(10)]
    assert canvas.get(4, 1) == BLACK
