"""Reading a batch's input file into lines: lines split across the pieces the file store reads, and the
cost of a long line."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from gateway.batch import lines as lines_module
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


async def test_a_line_longer_than_a_live_request_may_be_is_written_off_unparsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A live body past ``limits.max_body_bytes`` is refused before it is parsed; a batch line past it (and
    its envelope) is written off as ``request_too_large`` without being parsed either (parsing it, up to
    ``max_file_bytes``, would hold the event loop). Its neighbours are read as ever."""
    from gateway.batch.lines import LINE_ENVELOPE, too_large

    limit = 2048
    parsed_lines: list[bytes] = []
    check = lines_module.check_line

    def counting(raw: bytes, endpoint: str) -> Any:
        parsed_lines.append(raw)
        return check(raw, endpoint)

    monkeypatch.setattr(lines_module, "check_line", counting)
    small = chat_line("a", "x" * 100)
    fits = chat_line("b", "y" * (limit + LINE_ENVELOPE - 200))  # body over the limit: refused when it runs
    big = orjson.dumps(chat_line("c", "z" * (limit + LINE_ENVELOPE)))
    data = jsonl([small, fits, big, small | {"custom_id": "d"}])
    parsed = await parse_input(_pieces([data]), "/v1/chat/completions", 10, limit)
    assert big not in parsed_lines and len(parsed_lines) == 3
    assert [index for index, raw in enumerate(parsed.lines) if raw] == [0, 1, 3]
    assert parsed.malformed == [(2, None, *too_large(limit))]
    assert parsed.malformed[0][2] == "request_too_large" and not parsed.errors


async def test_validating_a_long_file_gives_the_event_loop_its_turn() -> None:
    """The file is read in one piece (no await of its own): validation still lets other tasks run every
    ``YIELD_EVERY`` (64) lines, so a long file never holds the loop for the whole of it."""
    data = jsonl([chat_line(f"q-{i}", "hi") for i in range(20 * 64)])
    turns = 0
    done = False

    async def other_task() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other_task())
    await asyncio.sleep(0)
    before = turns
    try:
        parsed = await parse_input(_pieces([data]), "/v1/chat/completions", 100_000)
    finally:
        done = True
        await task
    assert len(parsed.lines) == 20 * 64
    assert turns - before >= 19, turns - before
