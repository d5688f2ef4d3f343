"""A pass-through stream's usage and token count, found without parsing its events, and the request's
limit kept: ``StreamTap``.

When the only plugins that look at a stream need just its usage (``Plugin.reads_stream_text = False``:
tenancy, to bill), the stream keeps the pass-through and the core:

1. asks the worker for the usage event (``stream_options.include_usage``; ``ctx.ask_for_usage`` adds it
   to the request, as bytes when the client sent no ``stream_options``, so the body is not re-serialized);
2. finds that event in the bytes (a substring test per read), keeps its usage and, when the client did not
   ask for it, takes it out of what the client gets. A completion count the events before it cannot
   hold (``gateway.wire.completion_bound.most_streamed_tokens``: more tokens than their bytes) is a
   faulty or hostile worker's claim, not a count: no usage is kept (the tokens sent are billed, as for a
   stream without one), nor the recording (a stored answer would replay the claim); the client that
   asked for the event gets it as the worker sent it;
3. holds ``data: [DONE]`` back until those plugins' ``on_response`` ran with the usage (a response whose
   JSON is ``{"usage": ...}``), so a completed stream is charged before the client has all of it, as on
   the parsed path.

When a plugin asked for a recording of the stream (``ctx.record_stream``: the cache, to store the answer)
the tap also keeps its whole events, usage event included, up to the byte budget asked for and within the
room the process's recordings share (``gateway.pipeline.recordings``; past either, the events are added
up into the answer as they come, and only the answer is kept); once the stream completed, ``settlement``
hands them to those plugins' ``on_response`` as they came (``ModelResponse.recorded_events``) and parses
them into the assembled answer only if a plugin reads it, instead of parsing every event on its way out.

It also counts the events that carry generated text (substring counts per read, the way vLLM serializes
them) and, when the request has a completion limit (``gateway.proxy.token_limit``), ends the stream there
with ``finish_reason: "length"`` should the worker run past it.

Only whole events go out (a read's torn end waits for the next read), so the usage event and the ``[DONE]``
mark are always found whole; the bytes are otherwise sent as the worker wrote them.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.pipeline.context import ModelResponse
from gateway.pipeline.recordings import RecordingPool, Reservation
from gateway.proxy.answer import is_error_event
from gateway.proxy.token_limit import length_end
from gateway.wire.chat_answer import count
from gateway.wire.completion_bound import most_streamed_tokens
from gateway.wire.streaming import (
    DONE_MARK,
    USAGE_MEMBER,
    StreamAssembler,
    done_event_at,
    payload_lines,
    whole_payloads,
)

_EVENT = b"data:"
_DONE_EVENT = b"data: [DONE]\n\n"
_ERROR = b'"error":'


def output_events(piece: bytes) -> int:
    """How many choice deltas in ``piece`` carry generated output (vLLM sends one per token): the members
    that carry output, less those among them that are empty (a role or finish event). Called for every
    read of a tapped stream, so written out rather than looped over, and each empty form is counted only
    when the piece can hold it (a token event holds none)."""
    count = piece.count
    calls = count(b'"tool_calls":[')
    found = count(b'"content":"') + count(b'"text":"') + calls
    reasoning = piece.find(b'"reasoning') >= 0  # either name (gateway.wire.streaming.REASONING_FIELDS)
    if reasoning:
        found += count(b'"reasoning":"') + count(b'"reasoning_content":"')
    if found and piece.find(b'":""') >= 0:  # every empty text member has this
        found -= count(b'"content":""') + count(b'"text":""')
        if reasoning:
            found -= count(b'"reasoning":""') + count(b'"reasoning_content":""')
    if calls:
        found -= count(b'"tool_calls":[]')
    return found


class StreamTap:
    """See the module docstring. ``feed`` each piece of the stream in order; once ``limited``, the stream
    is over (the caller stops reading the worker)."""

    __slots__ = (
        "_choices",
        "_faulty",
        "_held",
        "_recording",
        "_relayed",
        "_strip",
        "limit",
        "limited",
        "tokens",
        "usage",
    )

    def __init__(
        self,
        *,
        strip: bool,
        limit: int | None = None,
        choices: int = 1,
        record: int = 0,
        recordings: RecordingPool | None = None,
    ) -> None:
        self._strip = strip  # the client did not ask for the usage event
        self._held = b""  # the start of an event that may be the usage event or the [DONE] mark
        self._recording: _Recording | None = None
        if record > 0:  # ``recordings``: the process's shared room (None: this recording's own budget only)
            self._recording = _Recording((recordings or RecordingPool(record)).reserve(record))
        self._choices = choices
        self._relayed = 0  # bytes of the events fed so far: what bounds the usage's completion count
        self._faulty = False  # the usage claimed more tokens than the events could hold
        self.limit = limit
        self.limited = False
        self.usage: dict[str, Any] | None = None
        self.tokens = 0  # generated tokens that went out (one per delta with output, as vLLM streams)

    def feed(self, piece: bytes) -> tuple[bytes, bytes]:
        """(whole events to send now, the ``[DONE]`` part held back until the usage plugins ran). The
        torn end of a read waits for the next one."""
        if self._held:
            piece, self._held = self._held + piece, b""
        if piece[-2:] != b"\n\n":  # torn inside an event (a read ends at an event's end most of the time)
            cut = piece.rfind(b"\n\n") + 2
            if cut < 2:
                self._held = piece
                return b"", b""
            piece, self._held = piece[:cut], piece[cut:]
        done = b""
        mark = piece.find(DONE_MARK)  # a piece starts at an event's start
        if mark > 0:  # rare: the event, or the same words in an answer's text
            mark = done_event_at(piece, mark)
        if mark >= 0:
            piece, done = piece[:mark], piece[mark:]
        recording = self._recording
        if recording is not None:
            room = recording.room - len(piece)
            if room >= 0 and recording.pieces is not None:  # _Recording.add's common case, without the call
                recording.room = room
                recording.pieces.append(piece)
            else:
                recording.add(piece)
        if piece.find(USAGE_MEMBER) >= 0:
            piece = self._take_usage(piece)
        self._relayed += len(piece)
        tokens = output_events(piece)
        if self.limit is not None and self.tokens + tokens > self.limit:
            return self._cut(piece), _DONE_EVENT
        self.tokens += tokens
        return piece, done

    def settlement(self, *, completed: bool) -> ModelResponse:
        """What the usage (and recording) plugins' ``on_response`` get once the worker's stream is over:
        the assembled answer when a recording was asked for and the stream completed (with its events in
        ``ModelResponse.recorded`` when they fitted the budget), else ``{"usage": ...}`` (``{}`` without)."""
        recording, self._recording = self._recording, None
        usage_only = {"usage": self.usage} if self.usage else {}
        if recording is not None and completed and not self.limited and not self._faulty:
            answer = recording.answer(usage_only)
            if answer is not None:
                return answer
        return ModelResponse(json=usage_only)

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
        """The completion tokens the client was sent: the usage's when the worker reported a count (a
        non-negative integer: a negative one would be billed as a credit), else the deltas that carried
        output."""
        usage = self.usage
        counted = count(usage.get("completion_tokens")) if usage is not None else None
        return counted if counted is not None else self.tokens

    def _take_usage(self, piece: bytes) -> bytes:
        """Keep the usage of the (whole) event that carries it, unless its completion count is more than
        the events so far can hold (then none: see the module's docstring); drop that event when the
        client did not ask for it."""
        at = piece.rfind(USAGE_MEMBER)
        start = piece.rfind(_EVENT, 0, at)
        end = piece.find(b"\n\n", at)
        try:
            event = orjson.loads(piece[start + len(_EVENT) : end])
        except orjson.JSONDecodeError:
            return piece
        usage = event.get("usage") if isinstance(event, dict) else None
        if isinstance(usage, dict):
            self.usage = usage
            completion = count(usage.get("completion_tokens"))
            held = self._relayed + start  # the events before this one, and its own when it has output
            held += end + 2 - start if event.get("choices") else 0
            if completion is not None and completion > most_streamed_tokens(held, self._choices):
                self.usage, self._faulty = None, True
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


class _Recording:
    """The whole events of a stream a plugin asked to have recorded: kept as bytes within ``reservation``
    (the recording's budget, and the room the process's recordings share), parsed once at the end; past
    it only added up as they come (an answer too long to keep with its events is still kept as an
    answer, as on the parsed path)."""

    __slots__ = ("_assembler", "_broken", "_reservation", "pieces", "room")

    def __init__(self, reservation: Reservation) -> None:
        self.pieces: list[bytes] | None = []  # None once past the budget (then added up as they come)
        self._reservation = reservation
        reservation.fits(1)  # the first grant: most streams need no other
        self.room = reservation.held  # what ``pieces`` may still take of the room held
        self._assembler = StreamAssembler()
        self._broken = False  # an event that is not JSON, or an error event: nothing to keep

    def add(self, events: bytes) -> None:
        """Keep ``events`` (whole events). ``StreamTap.feed`` appends to ``pieces`` itself while they fit
        the room held; here more is taken, or the events are added up from now on."""
        if self._broken:
            return
        if self.pieces is not None:
            reservation = self._reservation
            size = reservation.held - self.room + len(events)
            if reservation.fits(size):
                self.room = reservation.held - size
                self.pieces.append(events)
                return
            events, self.pieces = b"".join(self.pieces) + events, None
            reservation.release()
        self._broken = not _add_up(self._assembler, events, None)

    def answer(self, usage_only: dict[str, Any]) -> ModelResponse | None:
        """The answer; None when broken. Kept events are parsed only when a plugin reads the answer
        (``ModelResponse.assemble``): ``recorded``, and ``json`` unless an event turns out not to be JSON
        or an error event, when ``json`` is ``usage_only`` and ``recorded`` None, as for a stream that
        was not recorded. ``recorded_events`` holds them unparsed, unless one holds an error."""
        if self._broken:
            return None
        if self.pieces is None:  # past the budget: added up as they came
            return ModelResponse(json=self._assembler.result())
        events = b"".join(self.pieces)
        self.pieces = None
        self._reservation.release()  # the events go to the plugins now, to be stored or dropped
        assembler = self._assembler

        def assemble() -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
            chunks: list[dict[str, Any]] = []
            if not _add_up(assembler, events, chunks):
                return usage_only, None
            return assembler.result(), chunks

        response = ModelResponse(assemble=assemble)
        if events.find(_ERROR) < 0:  # a member named "error" outside any string: perhaps an error event
            response.recorded_events = _payload_lines(events)
        return response


def _payload_lines(events: bytes) -> bytes | None:
    """Whole events' payloads one per line: at once when each is one ``data: `` line, else through the
    SSE parser (comments, several lines); None when a payload spans lines."""
    lines = payload_lines(events)
    if lines is None:
        payloads = whole_payloads(events)
        if payloads and all(payload.find(b"\n") < 0 for payload in payloads):
            lines = b"\n".join(payloads)
    return lines


def _add_up(assembler: StreamAssembler, events: bytes, chunks: list[dict[str, Any]] | None) -> bool:
    """Add whole SSE ``events`` to ``assembler`` (and their parsed chunks to ``chunks``); False when one
    is not JSON or is an error event."""
    add = assembler.add
    for payload in whole_payloads(events):
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return False
        if not isinstance(chunk, dict) or is_error_event(chunk):
            return False
        add(chunk)
        if chunks is not None:
            chunks.append(chunk)
    return True
