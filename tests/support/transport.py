"""An in-process fake of the HTTP client to workers (``gateway.infra.http_api.HttpClient``), as httpx's
``MockTransport`` fakes a server in one line: ``UpstreamClient(config, FakeTransport(handler))``.

``handler(url, body)`` returns a ``Scripted`` answer: a status and body pieces, or a failure before the
headers (``connect``: refused, ``timeout``: no headers until the first-byte bound, ``garbage``: not HTTP),
or one after some pieces (``reset``: the connection broke, ``idle``: the idle bound ran out). The transport
records every request and counts the responses still open, so a test can check that each was released.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import orjson

from gateway.infra.http_api import HttpResponse, ProtocolError

Before = Literal["connect", "timeout", "garbage"]
After = Literal["reset", "idle"]


@dataclass
class Scripted:
    status: int = 200
    pieces: list[bytes] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    before: Before | None = None  # fail before the headers
    after: After | None = None  # fail once the pieces were read


Handler = Callable[[str, bytes], Scripted | Awaitable[Scripted]]


class FakeResponse:
    """A scripted response (``HttpResponse``)."""

    def __init__(self, script: Scripted, transport: FakeTransport) -> None:
        self._script = script
        self._pieces = list(script.pieces)
        self._transport = transport
        self._closed = False
        self.read_to_end = False

    @property
    def status(self) -> int:
        return self._script.status

    def header(self, name: str) -> str | None:
        return self._script.headers.get(name)

    async def chunk(self, idle_s: float | None) -> bytes:
        await asyncio.sleep(0)  # a read is a turn of the event loop, as on a socket
        if self._pieces:
            return self._pieces.pop(0)
        if self._script.after == "reset":
            raise ConnectionResetError("scripted reset")
        if self._script.after == "idle":
            raise TimeoutError
        self.read_to_end = True
        return b""

    async def read(self, idle_s: float | None) -> bytes:
        try:
            parts = []
            while piece := await self.chunk(idle_s):
                parts.append(piece)
            return b"".join(parts)
        finally:
            self.close()

    async def relay(
        self, sink: Callable[[bytes], bool], drained: Callable[[], Awaitable[None]], idle_s: float | None
    ) -> None:
        while piece := await self.chunk(idle_s):
            if not sink(piece):
                await drained()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._transport.open_now -= 1


class FakeTransport:
    """``HttpClient`` answering every POST with ``handler``'s script; see the module docstring."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self.requests: list[tuple[str, bytes]] = []
        self.open_now = 0

    async def post(
        self, url: str, body: bytes, headers: Mapping[str, str] | None, *, connect_timeout_s: float
    ) -> HttpResponse:
        self.requests.append((url, body))
        answer = self._handler(url, body)
        script = await answer if isinstance(answer, Awaitable) else answer
        await asyncio.sleep(0)
        if script.before == "connect":
            raise ConnectionRefusedError("scripted refusal")
        if script.before == "timeout":  # no headers: the caller's first-byte bound ends the wait
            await asyncio.sleep(3600)
        if script.before == "garbage":
            raise ProtocolError("scripted garbage")
        self.open_now += 1
        return FakeResponse(script, self)

    def set_limits(self, *, limit: int, limit_per_host: int, keepalive_s: float) -> None:
        return None

    async def aclose(self) -> None:
        return None


def chat_events(text: str, *, model: str = "m1", usage: bool = False) -> list[bytes]:
    """A chat stream as vLLM sends it: a role delta, one event per word, a finish, [DONE]."""
    base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1, "model": model}
    words = text.split(" ")
    deltas = [{"role": "assistant", "content": ""}] + [
        {"content": w if i == 0 else " " + w} for i, w in enumerate(words)
    ]
    events = [{**base, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    events.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    if usage:
        count = len(words)
        events.append({**base, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": count}})
    return [b"data: " + orjson.dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


def chat_answer(text: str, *, model: str = "m1") -> bytes:
    return orjson.dumps(
        {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 1,
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": len(text.split(" ")), "total_tokens": 0},
        }
    )
