"""A pass-through stream's usage, found without parsing its other events: ``UsageTap``.

When the only plugins that look at a stream need just its usage (``Plugin.reads_stream_text = False``:
tenancy, to bill), the stream keeps the pass-through and the core:

1. asks the worker for the usage event (``stream_options.include_usage``; ``ask_for_usage`` adds it to
   the request, as bytes when the client sent no ``stream_options``, so the body is not re-serialized);
2. finds that event in the bytes (a substring test per read), keeps its usage and, when the client did not
   ask for it, takes it out of what the client gets;
3. holds ``data: [DONE]`` back until those plugins' ``on_response`` ran with the usage (a response whose
   JSON is ``{"usage": ...}``), so a completed stream is charged before the client has all of it, as on
   the parsed path.

Only whole events go out (a read's torn end waits for the next read), so the usage event and the ``[DONE]``
mark are always found whole; the bytes are otherwise sent as the worker wrote them.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.pipeline.context import RequestContext
from gateway.wire.streaming import wants_usage

_USAGE = b'"usage":{'
_DONE = b"data: [DONE]"
_EVENT = b"data:"
#: Events that carry no generated token: a choice's role event, and an empty delta (a finish event).
_NO_TOKEN = (b'"role":', b'"delta":{}', b'"delta":{"content":""}')


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


class UsageTap:
    """See the module docstring. ``feed`` each piece of the stream in order."""

    __slots__ = ("_held", "_strip", "events", "usage")

    def __init__(self, *, strip: bool) -> None:
        self._strip = strip  # the client did not ask for the usage event
        self._held = b""  # the start of an event that may be the usage event or the [DONE] mark
        self.usage: dict[str, Any] | None = None
        self.events = 0  # events that went out with a generated token (one per token, as vLLM streams)

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
        self.events += piece.count(_EVENT) - sum(piece.count(mark) for mark in _NO_TOKEN)
        return piece, done

    def flush(self) -> bytes:
        """What is still held when the worker's bytes ended (a stream cut inside an event)."""
        held, self._held = self._held, b""
        return held

    def completion_tokens(self) -> int:
        """The completion tokens the client was sent: the usage's when the worker reported it, else the
        events that carried a token (vLLM sends one event per generated token)."""
        usage = self.usage
        counted = usage.get("completion_tokens") if usage is not None else None
        return counted if isinstance(counted, int) else max(0, self.events)

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
