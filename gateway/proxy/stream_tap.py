"""A pass-through stream's usage and token count, found without parsing its events, and the request's
limit kept: ``StreamTap``.

When the only plugins that look at a stream need just its usage (``Plugin.reads_stream_text = False``:
tenancy, to bill), the stream keeps the pass-through and the core:

1. asks the worker for the usage event (``stream_options.include_usage``; ``ask_for_usage`` adds it to
   the request, as bytes when the client sent no ``stream_options``, so the body is not re-serialized);
2. finds that event in the bytes (a substring test per read), keeps its usage and, when the client did not
   ask for it, takes it out of what the client gets;
3. holds ``data: [DONE]`` back until those plugins' ``on_response`` ran with the usage (a response whose
   JSON is ``{"usage": ...}``), so a completed stream is charged before the client has all of it, as on
   the parsed path.

It also counts the events that carry generated text (substring counts per read, the way vLLM serializes
them) and, when the request has a completion limit (``gateway.proxy.token_limit``), ends the stream there
with ``finish_reason: "length"`` should the worker run past it.

Only whole events go out (a read's torn end waits for the next read), so the usage event and the ``[DONE]``
mark are always found whole; the bytes are otherwise sent as the worker wrote them.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.pipeline.context import RequestContext
from gateway.proxy.token_limit import length_end
from gateway.wire.streaming import wants_usage

_USAGE = b'"usage":{'
_DONE = b"data: [DONE]"
_EVENT = b"data:"
#: A delta (or legacy choice) with generated output, and the same members empty (a role or finish event).
_OUTPUT = (b'"content":"', b'"text":"', b'"reasoning_content":"', b'"tool_calls":[')
_EMPTY = (b'"content":""', b'"text":""', b'"reasoning_content":""', b'"tool_calls":[]')
_DONE_EVENT = b"data: [DONE]\n\n"


def output_events(piece: bytes) -> int:
    """How many choice deltas in ``piece`` carry generated output (vLLM sends one per token)."""
    return sum(piece.count(mark) for mark in _OUTPUT) - sum(piece.count(mark) for mark in _EMPTY)


def ask_for_usage(ctx: RequestContext) -> bool:
    """Make the worker end ``ctx``'s stream with a usage event. Returns whether the client asked for it
    itself (else the tap strips it)."""
    body = ctx.body
    if wants_usage(body):
        return True
    options = body.get("stream_options")
    absent = "stream_options" not in body
    body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    raw = ctx.raw_body.lstrip()
    if absent and not ctx.body_changed and raw[:1] == b"{":
        # The client's bytes with one member in front: the changed body, without re-serializing it (the
        # body has a "model" member, so a comma always follows).
        ctx.raw_body = b'{"stream_options":{"include_usage":true},' + raw[1:]
    else:
        ctx.mark_body_changed()
    return False


class StreamTap:
    """See the module docstring. ``feed`` each piece of the stream in order; once ``limited``, the stream
    is over (the caller stops reading the worker)."""

    __slots__ = ("_choices", "_held", "_strip", "limit", "limited", "tokens", "usage")

    def __init__(self, *, strip: bool, limit: int | None = None, choices: int = 1) -> None:
        self._strip = strip  # the client did not ask for the usage event
        self._held = b""  # the start of an event that may be the usage event or the [DONE] mark
        self._choices = choices
        self.limit = limit
        self.limited = False
        self.usage: dict[str, Any] | None = None
        self.tokens = 0  # generated tokens that went out (one per delta with output, as vLLM streams)

    def feed(self, piece: bytes) -> tuple[bytes, bytes]:
        """(whole events to send now, the ``[DONE]`` part held back until the usage plugins ran). The
        torn end of a read waits for the next one."""
        if self._held:
            piece = self._held + piece
        cut = piece.rfind(b"\n\n") + 2
        if cut < 2:
            self._held = piece
            return b"", b""
        if cut == len(piece):
            self._held = b""
        else:
            piece, self._held = piece[:cut], piece[cut:]
        done = b""
        mark = piece.find(_DONE)
        if mark >= 0:
            piece, done = piece[:mark], piece[mark:]
        if _USAGE in piece:
            piece = self._take_usage(piece)
        tokens = output_events(piece)
        if self.limit is not None and self.tokens + tokens > self.limit:
            return self._cut(piece), _DONE_EVENT
        self.tokens += tokens
        return piece, done

    def _cut(self, piece: bytes) -> bytes:
        """The events of ``piece`` up to the limit, then the chunk that ends the answer there."""
        assert self.limit is not None
        kept: list[bytes] = []
        last = b""
        for event in piece.split(b"\n\n"):
            tokens = output_events(event)
            if not event or self.tokens + tokens > self.limit:
                break
            self.tokens += tokens
            kept.append(event + b"\n\n")
            last = event
        self.limited = True
        self._held = b""
        usage = self.usage
        if usage is not None:  # the worker's usage counts what it generated; the client got the limit
            prompt = usage.get("prompt_tokens")
            self.usage = {**usage, "completion_tokens": self.tokens}
            if isinstance(prompt, int):
                self.usage["total_tokens"] = prompt + self.tokens
        first = _json_of(last) or _json_of(piece[: piece.find(b"\n\n")])
        end = length_end(first, list(range(self._choices)))
        return b"".join(kept) + b"data: " + orjson.dumps(end) + b"\n\n"

    def flush(self) -> bytes:
        """What is still held when the worker's bytes ended (a stream cut inside an event)."""
        held, self._held = self._held, b""
        return held

    def completion_tokens(self) -> int:
        """The completion tokens the client was sent: the usage's when the worker reported it, else the
        deltas that carried output."""
        usage = self.usage
        counted = usage.get("completion_tokens") if usage is not None else None
        return counted if isinstance(counted, int) else self.tokens

    def _take_usage(self, piece: bytes) -> bytes:
        """Keep the usage of the (whole) event that carries it; drop that event when the client did not
        ask for it."""
        at = piece.rfind(_USAGE)
        start = piece.rfind(_EVENT, 0, at)
        end = piece.find(b"\n\n", at)
        try:
            event = orjson.loads(piece[start + len(_EVENT) : end])
        except orjson.JSONDecodeError:
            return piece
        usage = event.get("usage") if isinstance(event, dict) else None
        if isinstance(usage, dict):
            self.usage = usage
        if self._strip and isinstance(event, dict) and not event.get("choices"):
            return piece[:start] + piece[end + 2 :]
        return piece


def _json_of(event: bytes) -> dict[str, Any]:
    """An event's JSON object (``data: {...}``), or {} for anything else."""
    if not event.startswith(_EVENT):
        return {}
    try:
        parsed = orjson.loads(event[len(_EVENT) :])
    except orjson.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}
