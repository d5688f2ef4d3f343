"""A worker that answers every chat request with exact bytes, whatever they hold: for tests of what the
gateway does with an answer a real worker would not send (the translations into other APIs must call it
the worker's failure). Builders for a chat completion and a stream chunk with members replaced."""

from __future__ import annotations

from typing import Any

import orjson

GOOD_CHOICE = {"index": 0, "message": {"role": "assistant", "content": "Hello"}, "finish_reason": "stop"}


class ScriptedWorker:
    """Answers every chat request with ``body`` (status 200), or a streamed one with ``events`` (each the
    data of one SSE event), whatever they hold; ``requests`` are the chat bodies it was sent."""

    def __init__(self) -> None:
        self.body = b"{}"
        self.events: list[bytes] = []
        self.requests: list[dict[str, Any]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = orjson.loads(raw) if raw else {}
        if scope["path"].endswith("/chat/completions"):  # not the gateway's health probes, which come any time
            self.requests.append(request)
        streamed = request.get("stream") is True
        kind = b"text/event-stream" if streamed else b"application/json"
        body = b"".join(b"data: " + e + b"\n\n" for e in self.events) if streamed else self.body
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]})
        await send({"type": "http.response.body", "body": body})


def completion(**members: Any) -> bytes:
    """A chat completion whose choice 0 says "Hello", with ``members`` replaced."""
    return orjson.dumps({"id": "chatcmpl-1", "object": "chat.completion", "choices": [GOOD_CHOICE], **members})


def chunk(choice: Any = None, **members: Any) -> bytes:
    """A chat completion chunk with the one ``choice`` (none: ``choices`` is empty), ``members`` replaced."""
    choices = [choice] if choice is not None else []
    return orjson.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": choices, **members})


def _call(index: int, arguments: str, name: str | None = None) -> dict[str, Any]:
    """A tool call's delta: its first (with its id and ``name``) or a later one (arguments only)."""
    named: dict[str, Any] = (
        {"id": f"call_{index}", "type": "function", "function": {"name": name}} if name else {"function": {}}
    )
    named["function"]["arguments"] = arguments
    return {"index": index, **named}


def _delta(**fields: Any) -> bytes:
    return chunk({"index": 0, "delta": fields, "finish_reason": None})


def text_in_a_calls_last_chunk() -> list[bytes]:
    """A stream whose second chunk carries both the end of call 0's arguments and the text after the call
    (a worker sending several tokens per chunk: speculative decoding, ``--stream-interval``), then call 1:
    ``get_weather {"city": "Paris"}``, the text ``"\n"``, ``get_time {"zone": "UTC"}``."""
    return [
        _delta(role="assistant", tool_calls=[_call(0, '{"city": ', "get_weather")]),
        _delta(content="\n", tool_calls=[_call(0, '"Paris"}')]),  # the call's end and the text after it
        _delta(tool_calls=[_call(1, '{"zone": "UTC"}', "get_time")]),
        chunk({"index": 0, "delta": {}, "finish_reason": "tool_calls"}),
        chunk(None, usage={"prompt_tokens": 9, "completion_tokens": 12}),
        b"[DONE]",
    ]
