"""Reading a batch's input file into lines: lines split across the pieces the file store reads, and the
cost of a long line."""

from __future__ import annotations

import tracemalloc
from collections.abc import AsyncIterator

from gateway.batch.lines import parse_input, split_lines
from tests.support.batches import chat_line, jsonl


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
    """A 64 MiB line (within the default max_file_bytes) in the store's 1 MiB pieces, then a short one: the
    line's start is kept as its pieces until its newline comes, and joined once. Measured by the memory
    held between pieces, not by time: a copy of the line per piece (which took several seconds of the
    event loop) holds a MiB more after each piece."""
    piece = b"x" * (1 << 20)
    held: list[int] = []

    async def pieces() -> AsyncIterator[bytes]:
        for _ in range(64):
            yield piece
            held.append(tracemalloc.get_traced_memory()[0])  # the splitter has taken the piece in
        yield b"\n{}\n"

    tracemalloc.start()
    try:
        lines = [line async for line in split_lines(pieces())]
    finally:
        tracemalloc.stop()
    assert [len(line) for line in lines] == [64 << 20, 2]
    assert max(held) - held[0] < 64 << 10, f"{(max(held) - held[0]) >> 10} KiB held as the line grew"


async def test_a_byte_order_mark_at_the_start_of_the_file_is_not_part_of_the_first_line() -> None:
    """Windows editors and PowerShell start a UTF-8 file with a byte order mark: the first line is read
    without it (it was malformed JSON); a mark anywhere else is the line's own, and malformed."""
    bom = b"\xef\xbb\xbf"
    data = jsonl([chat_line("a", "x"), chat_line("b", "y")])
    for source in (bom + data, bom + b"\n" + data):
        parsed = await parse_input(_pieces([source[:2], source[2:]]), "/v1/chat/completions", 10)
        assert (parsed.errors, parsed.malformed, len(parsed.lines)) == ([], [], 2)
        assert parsed.lines[0] == jsonl([chat_line("a", "x")]).strip()
    inner = await parse_input(_pieces([jsonl([chat_line("a", "x")]) + bom + jsonl([chat_line("b", "y")])]),
                              "/v1/chat/completions", 10)  # fmt: skip
    assert inner.errors == [] and [code for _, _, code, _ in inner.malformed] == ["invalid_json"]
