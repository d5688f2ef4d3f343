"""Server-sent events: framing, assembling a stream into one response, replaying a response as a stream.

Shapes follow what vLLM (and OpenAI) send: ``chat.completion.chunk`` objects with ``delta``s, or
``text_completion`` objects with ``text`` pieces, a usage-only chunk (``choices: []``) when
``stream_options.include_usage`` is set, then ``data: [DONE]``.

Byte tests that run per read or per event use ``data.find(needle) >= 0``, not ``needle in data``: for a
bytes needle, ``in`` first tries it as an integer and raises and clears a ``TypeError`` before searching,
which makes a short test two to three times slower (``tests/architecture/test_bytes_membership.py``
keeps the request path free of it).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"
DONE_MARK = b"data: [DONE]"
_LINE_ENDS = (10, 13)  # the bytes before a line's start: a line feed, a carriage return


def done_event_at(data: bytes, start: int = 0) -> int:
    """Where the ``[DONE]`` event starts in ``data`` (which starts a line), looking from ``start``: the
    mark at a line's start, not the same words inside an event's text (an answer may say them, several
    tokens in one delta can), since no line break is inside an event's JSON; -1 when there is none."""
    at = data.find(DONE_MARK, start)
    while at > 0 and data[at - 1] not in _LINE_ENDS:
        at = data.find(DONE_MARK, at + 1)
    return at


SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def encode_event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def wants_usage(body: dict[str, Any]) -> bool:
    """Whether a stream request asks for the usage chunk (``stream_options.include_usage``)."""
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def delta_tokens(chunk: dict[str, Any]) -> int:
    """Completion tokens one stream chunk carries, counted the way vLLM streams them: one per choice
    whose delta has text, reasoning or a tool call (a role-only or finish-only delta carries none)."""
    count = 0
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        if delta is None:
            count += 1 if choice.get("text") else 0
        elif delta.get("content") or delta.get("tool_calls") or any(delta.get(name) for name in REASONING_FIELDS):
            count += 1
    return count


#: The members that carry a chat answer's reasoning: ``reasoning`` is what vLLM writes (0.32, installed here),
#: ``reasoning_content`` what earlier releases and other OpenAI-style servers write. Both are kept as sent.
REASONING_FIELDS = ("reasoning", "reasoning_content")


_DATA = b"data: "
_NEXT_EVENT = b"\n\ndata: "
#: The member that carries an event's usage object; it cannot match inside a string (quotes are escaped).
USAGE_MEMBER = b'"usage":{'


class SSEParser:
    """Splits a byte stream into SSE ``data:`` payloads (bytes), across arbitrary chunk boundaries."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf + data if self._buf else data
        if buf.find(b"\r") >= 0:
            buf = buf.replace(b"\r\n", b"\n")
        events: list[bytes] = []
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            payload = _data_of(buf[start:end])
            if payload is not None:
                events.append(payload)
            start = end + 2
        self._buf = buf[start:]
        return events

    @property
    def pending(self) -> bytes:
        return self._buf


def whole_payloads(events: bytes) -> list[bytes]:
    """The ``data:`` payloads of whole SSE events (nothing torn at the end), as ``SSEParser`` reads them;
    split at once when each event is one ``data: `` line, as workers write them."""
    parts = events.split(b"\n\n")
    if not parts[-1] and events.find(b"\r") < 0:
        del parts[-1]
        if all(part.startswith(_DATA) and part.find(b"\n") < 0 for part in parts):
            return [part[6:] for part in parts]
    return SSEParser().feed(events)


def payload_lines(events: bytes) -> bytes | None:
    """The ``data:`` payloads of whole SSE events joined one per line (the form of stored stream events),
    when each event is one ``data: `` line, as workers write them; None otherwise. Every line feed must
    then be in an event's end (a payload holds none: JSON escapes them in strings)."""
    if not events.startswith(_DATA) or not events.endswith(b"\n\n") or events.find(b"\r") >= 0:
        return None
    if events.count(b"\n") != 2 * events.count(_NEXT_EVENT) + 2:
        return None
    return events[6:-2].replace(_NEXT_EVENT, b"\n")


def _data_of(event: bytes) -> bytes | None:
    if event.startswith(_DATA) and event.find(b"\n") < 0:  # one data line, as workers write every event
        return event[6:]
    parts = []
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            parts.append(line[5:].removeprefix(b" "))
    return b"\n".join(parts) if parts else None


class StreamAssembler:
    """Builds the complete response a stream adds up to (chat or legacy completions)."""

    def __init__(self) -> None:
        self.meta: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, Any] | None = None
        self.finished = False

    def add(self, chunk: dict[str, Any]) -> None:
        if self.meta and len(chunk) == 5 and "usage" not in chunk:  # id, object, created, model, choices
            choices = chunk.get("choices")
            if type(choices) is list and len(choices) == 1 and self._add_token(choices[0]):
                return
        if not self.meta:
            self.meta = {k: chunk[k] for k in ("id", "created", "model", "system_fingerprint") if k in chunk}
            self.meta["object"] = chunk.get("object", "chat.completion.chunk")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            index = choice.get("index", 0)
            acc = self.choices.get(index)
            if acc is None:
                acc = self.choices[index] = {"index": index}
            if "delta" in choice:
                _merge_delta(acc, choice.get("delta") or {})
            elif choice.get("text"):
                _pieces(acc, "text").append(choice["text"])
            if choice.get("logprobs"):
                _merge_logprobs(acc, choice["logprobs"])
            if choice.get("finish_reason") is not None:
                acc["finish_reason"] = choice["finish_reason"]
                if "stop_reason" in choice:
                    acc["stop_reason"] = choice["stop_reason"]

    def _add_token(self, choice: Any) -> bool:
        """The common chunk after the first, in one step: one choice whose delta carries only content,
        no logprobs, no finish. False (nothing done) for anything else."""
        if type(choice) is not dict or len(choice) != 4 or choice.get("logprobs") is not None:
            return False
        delta = choice.get("delta")
        if type(delta) is not dict or len(delta) != 1 or choice.get("finish_reason") is not None:
            return False
        piece = delta.get("content")
        acc = self.choices.get(choice.get("index", 0))
        if type(piece) is not str or not piece or acc is None or type(acc.get("content")) is not list:
            return False
        acc["content"].append(piece)
        return True

    @property
    def complete(self) -> bool:
        """Every choice has a finish_reason (a cut stream does not)."""
        return bool(self.choices) and all(c.get("finish_reason") is not None for c in self.choices.values())

    def result(self) -> dict[str, Any]:
        is_chat = self.meta.get("object", "").startswith("chat")
        out: dict[str, Any] = {k: v for k, v in self.meta.items() if k != "object"}
        out["object"] = "chat.completion" if is_chat else "text_completion"
        choices = []
        for index in sorted(self.choices):
            acc = self.choices[index]
            if is_chat:
                content = _joined(acc.get("content"))
                message: dict[str, Any] = {"role": acc.get("role", "assistant"), "content": content}
                for name in REASONING_FIELDS:
                    if acc.get(name):
                        message[name] = _joined(acc[name])
                if acc.get("tool_calls"):
                    message["tool_calls"] = [_tool_call(acc["tool_calls"][i]) for i in sorted(acc["tool_calls"])]
                    if content == "":  # only vLLM's role event's "": a whole answer of tool calls only has none
                        message["content"] = None
                choice: dict[str, Any] = {"index": index, "message": message}
            else:
                choice = {"index": index, "text": _joined(acc.get("text")) or ""}
            choice["logprobs"] = acc.get("logprobs")
            choice["finish_reason"] = acc.get("finish_reason")
            if "stop_reason" in acc:
                choice["stop_reason"] = acc["stop_reason"]
            choices.append(choice)
        out["choices"] = choices
        if self.usage is not None:
            out["usage"] = self.usage
        return out


# Text arrives in pieces and is kept as a list of them, joined once by ``result``: adding each piece to
# a string held in a dict copies all of it every time (quadratic in the length of the answer).


def _pieces(acc: dict[str, Any], key: str) -> list[str]:
    parts = acc.get(key)
    if not isinstance(parts, list):  # absent, or the "" / None of a delta that carried no text yet
        parts = acc[key] = []
    return parts


def _joined(value: Any) -> Any:
    return "".join(value) if isinstance(value, list) else value


def _tool_call(slot: dict[str, Any]) -> dict[str, Any]:
    return {**slot, "function": {**slot["function"], "arguments": _joined(slot["function"]["arguments"])}}


def _merge_delta(acc: dict[str, Any], delta: dict[str, Any]) -> None:
    if delta.get("role"):
        acc["role"] = delta["role"]
    piece = delta.get("content")
    if piece:
        _pieces(acc, "content").append(piece)
    elif "content" in delta and "content" not in acc:
        acc["content"] = piece
    for name in REASONING_FIELDS:
        piece = delta.get(name)
        if piece:
            _pieces(acc, name).append(piece)
    for call in delta.get("tool_calls") or ():
        calls = acc.setdefault("tool_calls", {})
        slot = calls.setdefault(call.get("index", len(calls)), {"type": "function", "function": {"arguments": []}})
        if call.get("id"):
            slot["id"] = call["id"]
        if call.get("type"):
            slot["type"] = call["type"]
        fn = call.get("function") or {}
        if fn.get("name"):
            slot["function"]["name"] = fn["name"]
        if fn.get("arguments"):
            slot["function"]["arguments"].append(fn["arguments"])


def _merge_logprobs(acc: dict[str, Any], logprobs: dict[str, Any]) -> None:
    current = acc.get("logprobs")
    if current is None:
        acc["logprobs"] = {k: (list(v) if isinstance(v, list) else v) for k, v in logprobs.items()}
        return
    for key, value in logprobs.items():
        if isinstance(value, list) and isinstance(current.get(key), list):
            current[key].extend(value)


def replay_chunks(payloads: bytes, *, include_usage: bool) -> Iterator[bytes]:
    """Recorded stream events (JSON payloads, one per line) as they were first sent, then ``[DONE]``,
    in one piece; without ``include_usage`` the usage-only event is left out and no event has ``usage``."""
    if not include_usage and payloads.find(b'"usage"') >= 0:
        kept: list[bytes] = []
        for payload in payloads.split(b"\n"):
            if payload.find(b'"usage"') >= 0:
                chunk = orjson.loads(payload)
                if not chunk.get("choices"):
                    continue
                chunk.pop("usage", None)
                payload = orjson.dumps(chunk)
            kept.append(payload)
        payloads = b"\n".join(kept)
    if not payloads:
        yield DONE
        return
    yield b"data: " + payloads.replace(b"\n", b"\n\ndata: ") + b"\n\n" + DONE


def replay(response: dict[str, Any], *, include_usage: bool) -> Iterator[bytes]:
    """A complete response as the SSE events a worker would have streamed, ending with ``[DONE]``."""
    is_chat = response.get("object") == "chat.completion" or any("message" in c for c in response.get("choices") or ())
    base: dict[str, Any] = {k: response[k] for k in ("id", "created", "model", "system_fingerprint") if k in response}
    base["object"] = "chat.completion.chunk" if is_chat else "text_completion"
    for choice in response.get("choices") or ():
        yield from (_chat_events if is_chat else _text_events)(base, choice)
    if include_usage and response.get("usage") is not None:
        yield encode_event({**base, "choices": [], "usage": response["usage"]})
    yield DONE


def _chat_events(base: dict[str, Any], choice: dict[str, Any]) -> Iterator[bytes]:
    """One chat choice: the role, then everything the message holds in one delta, then the finish."""
    index = choice.get("index", 0)
    msg = choice.get("message") or {}
    role = {"index": index, "delta": {"role": msg.get("role", "assistant"), "content": ""}}
    yield encode_event({**base, "choices": [{**role, "logprobs": None, "finish_reason": None}]})
    delta: dict[str, Any] = {}
    for name in REASONING_FIELDS:
        if msg.get(name):
            delta[name] = msg[name]
    if msg.get("content"):
        delta["content"] = msg["content"]
    if msg.get("tool_calls"):
        delta["tool_calls"] = [{**call, "index": i} for i, call in enumerate(msg["tool_calls"])]
    if delta:
        content = {"index": index, "delta": delta, "logprobs": choice.get("logprobs"), "finish_reason": None}
        yield encode_event({**base, "choices": [content]})
    yield _final_event(base, choice, {"index": index, "delta": {}})


def _text_events(base: dict[str, Any], choice: dict[str, Any]) -> Iterator[bytes]:
    """One completions choice: its text in one event, then the finish."""
    index = choice.get("index", 0)
    if choice.get("text"):
        text = {"index": index, "text": choice["text"], "logprobs": choice.get("logprobs"), "finish_reason": None}
        yield encode_event({**base, "choices": [text]})
    yield _final_event(base, choice, {"index": index, "text": ""})


def _final_event(base: dict[str, Any], choice: dict[str, Any], head: dict[str, Any]) -> bytes:
    final = {**head, "logprobs": None, "finish_reason": choice.get("finish_reason")}
    if "stop_reason" in choice:
        final["stop_reason"] = choice["stop_reason"]
    return encode_event({**base, "choices": [final]})
