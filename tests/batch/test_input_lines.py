"""Reading a batch's input file into lines: lines split across the pieces the file store reads, and the
cost of a long line."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from gateway.batch.lines import split_lines


async def _pieces(pieces: list[bytes]) -> AsyncIterator[bytes]:
    for piece in pieces:
        yield piece


async def _lines(pieces: list[bytes]) -> list[bytes]:
    return [line async for line in split_lines(_pieces(pieces))]


async def test_lines_are_split_wherever_the_pieces_end() -> None:
    data = b'{"a": 1}\n\n{"b": 22}\r\n  \n{"c": 333}'
    expected = [b'{"a": 1}', b'{"b": 22}\r', b'{"c": 333}']
    for size in (1, 2, 3, 7, len(data)):
        assert await _lines([data[i : i + size] for i in range(0, len(data), size)]) == expected
    assert await _lines([b"x\n", b"", b"\n", b"y"]) == [b"x", b"y"]
    assert await _lines([]) == []


async def test_a_long_line_costs_its_length_not_its_square() -> None:
    # a 64 MiB line (within the default max_file_bytes) in the store's 1 MiB pieces, then a short one
    pieces = [b"x" * (1 << 20)] * 64 + [b"\n{}\n"]
    started = time.process_time()
    lines = await _lines(pieces)
    spent = time.process_time() - started
    assert [len(line) for line in lines] == [64 << 20, 2]
    assert spent < 1.0, spent  # a copy of the line per piece took several seconds of the event loop
