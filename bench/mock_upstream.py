"""A fast mock OpenAI worker for benchmarks: raw asyncio on uvloop with httptools, one process.

- ``POST /v1/chat/completions`` and ``/v1/completions``: a small fixed JSON answer, or, with
  ``"stream": true``, an SSE stream of ``max_tokens`` content chunks (``--chunks`` by default) paced
  ``--interval-ms`` apart, a usage chunk when ``stream_options.include_usage`` is set, then ``[DONE]``.
  The first event (the role delta) is sent at once, so time-to-first-chunk measures the hop, not the mock.
  A request sent straight to the mock may set its own pace with the non-OpenAI field
  ``mock_interval_ms`` (a gateway refuses unknown fields, so the memory benchmark runs a slow mock).
- ``GET /health`` (200) and ``GET /v1/models``, so a gateway's health checks see a healthy worker.

It skips every framework so the mock is never the bottleneck of the hop being measured.

    python bench/mock_upstream.py --port 9100 --interval-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Any, cast

import httptools
import orjson
import uvloop

CHAT_ANSWER = orjson.dumps(  # also the in-process worker's answer in bench/bench_request_path.py
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "mock",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello! How can I help you today?"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 9, "total_tokens": 21},
    }
)
_TEXT = orjson.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 1700000000,
        "model": "mock",
        "choices": [{"index": 0, "text": " Hello there.", "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }
)
_MODELS = b'{"object":"list","data":[{"id":"mock","object":"model","owned_by":"bench"}]}'


def _json_response(status: bytes, body: bytes, keep_alive: bool) -> bytes:
    conn = b"keep-alive" if keep_alive else b"close"
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
        b"%d\r\nconnection: %s\r\n\r\n" % (len(body), conn) + body
    )


_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def _chunked(event: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(event), event)


def _stream_events(chat: bool, tokens: int, include_usage: bool) -> list[bytes]:
    """Every SSE event of one stream, already framed as HTTP chunks (the mock only paces them)."""
    framed = [_chunked(event) for event in stream_events(chat, tokens, include_usage)]
    framed[-1] += b"0\r\n\r\n"
    return framed


def stream_events(chat: bool, tokens: int, include_usage: bool) -> list[bytes]:
    """Every SSE event of one stream as a worker writes it (``data: {...}\\n\\n``, ``[DONE]`` last): the
    mock's, and the in-process worker's in bench/bench_request_path.py."""
    base: dict[str, Any] = {"id": "chatcmpl-bench", "created": 1700000000, "model": "mock"}
    base["object"] = "chat.completion.chunk" if chat else "text_completion"

    def choice(piece: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if piece is not None:
                delta["content"] = piece
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}

    events = [{**base, "choices": [choice(None, None, role=True)]}] if chat else []
    events += [{**base, "choices": [choice(f"tok{i} ", None)]} for i in range(tokens)]
    events.append({**base, "choices": [choice(None, "stop")]})
    if include_usage:
        usage = {"prompt_tokens": 12, "completion_tokens": tokens, "total_tokens": 12 + tokens}
        events.append({**base, "choices": [], "usage": usage})
    return [b"data: " + orjson.dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


class MockProtocol(asyncio.Protocol):
    """One client connection: HTTP/1.1 keep-alive, one request at a time."""

    def __init__(self, interval_s: float, default_chunks: int) -> None:
        self.interval_s = interval_s
        self.default_chunks = default_chunks
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.timer: asyncio.TimerHandle | None = None
        self.loop = asyncio.get_running_loop()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.transport = None

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        transport = self.transport
        if transport is None:
            return
        keep_alive = self.parser.should_keep_alive()
        method = self.parser.get_method()
        path = self.url.split(b"?", 1)[0]
        if method == b"GET":
            if path == b"/health":
                transport.write(_json_response(b"200 OK", b"{}", keep_alive))
            elif path == b"/v1/models":
                transport.write(_json_response(b"200 OK", _MODELS, keep_alive))
            else:
                transport.write(_json_response(b"404 Not Found", b'{"error":"not found"}', keep_alive))
        elif method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions"):
            self._completion(transport, path == b"/v1/chat/completions", keep_alive)
            return
        else:
            transport.write(_json_response(b"404 Not Found", b'{"error":"not found"}', keep_alive))
        if not keep_alive:
            transport.close()

    def _completion(self, transport: asyncio.Transport, chat: bool, keep_alive: bool) -> None:
        try:
            request = orjson.loads(b"".join(self.body))
        except orjson.JSONDecodeError:
            transport.write(_json_response(b"400 Bad Request", b'{"error":"bad json"}', keep_alive))
            return
        if not request.get("stream"):
            transport.write(_json_response(b"200 OK", CHAT_ANSWER if chat else _TEXT, keep_alive))
            if not keep_alive:
                transport.close()
            return
        options = request.get("stream_options") or {}
        tokens = request.get("max_tokens") or self.default_chunks
        interval_ms = request.get("mock_interval_ms")
        interval_s = interval_ms / 1000 if isinstance(interval_ms, int | float) else self.interval_s
        events = _stream_events(chat, int(tokens), bool(options.get("include_usage")))
        transport.write(_SSE_HEAD + events[0])
        self.timer = self.loop.call_later(interval_s, self._pace, events, 1, interval_s, keep_alive)

    def _pace(self, events: list[bytes], index: int, interval_s: float, keep_alive: bool) -> None:
        self.timer = None
        transport = self.transport
        if transport is None:
            return
        transport.write(events[index])
        if index + 1 < len(events):
            self.timer = self.loop.call_later(interval_s, self._pace, events, index + 1, interval_s, keep_alive)
        elif not keep_alive:
            transport.close()


async def serve(host: str, port: int, interval_s: float, chunks: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: MockProtocol(interval_s, chunks), host, port, backlog=4096)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"mock upstream on http://{host}:{port} (interval {interval_s * 1000:g} ms)", flush=True)
    async with server:
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--interval-ms", type=float, default=20.0, help="gap between streamed chunks")
    parser.add_argument("--chunks", type=int, default=32, help="content chunks per stream without max_tokens")
    args = parser.parse_args()
    uvloop.run(serve(args.host, args.port, args.interval_ms / 1000, args.chunks))


if __name__ == "__main__":
    main()
