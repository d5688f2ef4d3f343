"""A batch's input lines and its output lines, in OpenAI's shapes.

Input: one JSON object per line, ``{"custom_id", "method": "POST", "url", "body"}``, ``url`` the
batch's endpoint. A line that is not such an object goes to the error file (with its ``custom_id`` when
it has one); an input that is no batch at all (empty, too many lines, a ``custom_id`` used twice) fails
the batch with ``errors``, as OpenAI's validation does.

Output: ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``: an answer
in the output file; a refusal (the body is the OpenAI error) in the error file; a line that never ran
(malformed, expired, cancelled) in the error file with ``response`` null and ``error`` ``{code, message}``.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.wire.protocol import MAX_DEPTH, too_deep

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
_PREFIX_CHARS = 2048
#: Room a line takes beside its body (``custom_id`` of up to 512 characters, escaped at worst, ``method``,
#: ``url``, the keys): a line longer than its body's bound by more than this is over the bound for sure.
LINE_ENVELOPE = 4096
#: Validation gives the event loop its turn after this many lines, or this many bytes of lines, since its
#: last: a long file never holds the loop for long, only one line's parse at most.
YIELD_EVERY = 64
YIELD_BYTES = 256 * 1024
TOO_LARGE = "request_too_large"


def line_bound(max_body_bytes: int) -> int:
    """The longest input line parsed: a live request's body bound (``limits.max_body_bytes``, refused
    before it is read) plus the line's envelope. A longer line is written off unparsed (``too_large``), so
    no line occupies the event loop longer than a live request's body could."""
    return max_body_bytes + LINE_ENVELOPE


def too_large(max_body_bytes: int) -> tuple[str, str]:
    """The code and message of a line written off for its size (the live routes' 413 code)."""
    return TOO_LARGE, (
        f"The line is larger than this gateway accepts for a request ({max_body_bytes} bytes, limits."
        "max_body_bytes, plus the line's custom_id, method and url); it was not read."
    )


@dataclass
class Parsed:
    """A validated input: runnable lines (raw JSON by index), lines written off, the batch's errors."""

    lines: list[bytes] = field(default_factory=list)
    keys: list[tuple[str, str]] = field(default_factory=list)  # per line: (model, prompt prefix)
    malformed: list[tuple[int, str | None, str, str]] = field(default_factory=list)  # (index, custom_id, code, msg)
    errors: list[dict[str, Any]] = field(default_factory=list)

    def run_order(self) -> list[int]:
        """Indexes of runnable lines, grouped by model and shared prompt prefix (a worker's prefix cache
        then serves the common start of neighbouring lines)."""
        return sorted((i for i, raw in enumerate(self.lines) if raw), key=lambda i: self.keys[i])


#: A UTF-8 byte order mark: Windows editors and PowerShell's UTF-8 output start a file with one.
_BOM = b"\xef\xbb\xbf"


async def split_lines(pieces: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The lines of a stream of byte pieces (without their newlines; blank lines skipped). A line's start
    is kept as its pieces and joined once, so a long line costs its length, not its length squared."""
    rest: list[bytes] = []
    async for piece in pieces:
        *whole, tail = piece.split(b"\n")
        if whole:
            whole[0] = b"".join([*rest, whole[0]])
            rest = []
            for line in whole:
                if line.strip():
                    yield line
        rest.append(tail)
    last = b"".join(rest)
    if last.strip():
        yield last


def _prefix(body: dict[str, Any]) -> str:
    for name in ("messages", "prompt", "input"):
        if name in body:
            value = body[name]
            text = value if isinstance(value, str) else orjson.dumps(value).decode()
            return str(body.get("instructions") or "") + text[:_PREFIX_CHARS]
    return ""


def check_line(raw: bytes, endpoint: str) -> tuple[str | None, str, str] | dict[str, Any]:
    """The parsed line, or (custom_id or None, error code, message) for a malformed one."""
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None, "invalid_json", "The line is not valid JSON."
    if not isinstance(line, dict):
        return None, "invalid_request", "The line must be a JSON object."
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
        return None, "missing_custom_id", "The line needs a 'custom_id' string (at most 512 characters)."
    if line.get("method") != "POST":
        return custom_id, "invalid_method", "The line's 'method' must be 'POST'."
    if line.get("url") != endpoint:
        return custom_id, "mismatched_url", f"The line's 'url' must be the batch's endpoint, '{endpoint}'."
    body = line.get("body")
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return custom_id, "invalid_body", "The line's 'body' must be a JSON object with a 'model'."
    if too_deep(raw, body):  # as a live request's
        return custom_id, "invalid_body", f"The line's 'body' is nested more than {MAX_DEPTH} levels deep."
    if body.get("stream"):
        return custom_id, "invalid_body", "Batch lines cannot stream; remove 'stream' from the body."
    return line


async def parse_input(
    pieces: AsyncIterator[bytes], endpoint: str, max_lines: int, max_body_bytes: int | None = None
) -> Parsed:
    """Validate an input file. With ``max_body_bytes``, a line longer than ``line_bound`` of it is written
    off (``too_large``, no ``custom_id``: it is not parsed to find one). The loop gets its turn every
    ``YIELD_EVERY`` lines or ``YIELD_BYTES``."""
    parsed = Parsed()
    seen: set[str] = set()
    lines, size = 0, 0  # since the loop last had its turn
    async for raw in split_lines(pieces):
        lines, size = lines + 1, size + len(raw)
        if lines > YIELD_EVERY or size > YIELD_BYTES:
            await asyncio.sleep(0)
            lines, size = 1, len(raw)
        if not parsed.lines and raw.startswith(_BOM):  # the file's own mark, not its first line's
            raw = raw[len(_BOM) :]
            if not raw.strip():
                continue
        index = len(parsed.lines)
        if index >= max_lines:
            parsed.errors.append(_batch_error("too_many_lines", f"The input has more than {max_lines} lines.", None))
            return parsed
        if max_body_bytes is not None and len(raw) > line_bound(max_body_bytes):
            parsed.malformed.append((index, None, *too_large(max_body_bytes)))
            parsed.lines.append(b"")
            parsed.keys.append(("", ""))
            continue
        checked = check_line(raw, endpoint)
        custom_id = checked[0] if isinstance(checked, tuple) else checked["custom_id"]
        # A result names its line by custom_id (a malformed one's too): two lines with one would be
        # one line to whoever reads the files. A line without one is named by its place in the file
        # (its error's message), which no custom_id can take.
        if custom_id in seen:
            message = f"The custom_id '{custom_id}' is used by more than one line; each must be unique."
            parsed.errors.append(_batch_error("duplicate_custom_id", message, index + 1))
            return parsed
        if custom_id is not None:
            seen.add(custom_id)
        if isinstance(checked, tuple):
            parsed.malformed.append((index, *checked))
            parsed.lines.append(b"")
            parsed.keys.append(("", ""))
            continue
        parsed.lines.append(raw)
        parsed.keys.append((checked["body"]["model"], _prefix(checked["body"])))
    if not parsed.lines:
        parsed.errors.append(_batch_error("empty_file", "The input file has no lines.", None))
    return parsed


def _batch_error(code: str, message: str, line: int | None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": None, "line": line}


def output_line(custom_id: str | None, status: int, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """A line that ran: its answer, or the OpenAI error it was refused with."""
    return {
        "id": "batch_req_" + secrets.token_hex(12),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


def error_line(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """A line that never ran (malformed, expired, cancelled)."""
    return {
        "id": "batch_req_" + secrets.token_hex(12),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
