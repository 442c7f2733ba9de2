"""The PNG writer: valid files (signature, IHDR, CRCs, pixel rows), drawing and the chart."""

from __future__ import annotations

import struct
import zlib

import pytest

from shard_cli._png import BLACK, WHITE, Canvas, encode_png, training_chart


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


def test_training_chart_is_a_valid_png_with_drawing_on_it() -> None:
    """The chart decodes at the size asked, and its loss curve and bars leave colored pixels."""
    curve = [(step, 4.0 / step) for step in range(1, 21)]
    ranks = [("rank 0", 1000, 1000, 2000, 9000), ("rank 1", 1000, 1000, 2000, 8000)]
    width, height, pixels = read_png(training_chart(curve, ranks, title="t", width=300, height=200))
    assert (width, height) == (300, 200)
    colors = {pixels[i : i + 3] for i in range(0, len(pixels), 3)}
    assert bytes((31, 119, 180)) in colors  # the curve and the params bars
    assert bytes((214, 39, 40)) in colors  # the peak bars
