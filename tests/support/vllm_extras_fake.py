"""A fake vLLM worker for what ``tests.support.fakes.FakeUpstream`` does not answer: the utility routes
(``/tokenize``, ``/detokenize``, ``/version``) and chat completions that call a tool (whole and streamed,
the arguments split over several deltas as vLLM's parsers send them). Served on a real socket."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from tests.support.fakes import FakeUpstream, Seen

_MINE = frozenset({"/version", "/tokenize", "/detokenize", "/v1/chat/completions"})


@dataclass
class ExtrasWorker(FakeUpstream):
    """``FakeUpstream`` (health, lifespan, the other endpoints) plus the routes above."""

    name: str = "extras"
    version: str | None = "0.32.0-fake"  # None: /version is not served (404)
    arguments: str = '{"city": "Paris"}'  # what the tool call's arguments say
    pieces: int = 4  # how many deltas carry the arguments when streamed

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path")
        if scope["type"] != "http" or path not in _MINE:
            await super().__call__(scope, receive, send)
            return
        raw = b""
        more = True
        while more:
            message = await receive()
            raw += message.get("body", b"")
            more = message.get("more_body", False)
        body = orjson.loads(raw) if raw else {}
        self.requests.append(Seen(path, body, raw, {k.decode(): v.decode() for k, v in scope["headers"]}))
        if path == "/version" and self.version is not None:
            await _send(send, 200, {"version": self.version})
        elif path == "/tokenize":
            # One "token" per word, its id the word's length; enough to see the worker answered.
            words = str(body.get("prompt", "")).split()
            await _send(send, 200, {"count": len(words), "max_model_len": 2048, "tokens": [len(w) for w in words]})
        elif path == "/detokenize":
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
                error = {"message": "tokens must be non-negative integers", "type": "BadRequestError", "code": 400}
                await _send(send, 400, {"error": {**error, "param": "tokens"}})
                return
            await _send(send, 200, {"prompt": f"{self.name}:" + " ".join("x" * t for t in tokens)})
        elif path == "/v1/chat/completions" and body.get("stream"):
            await self._stream(body, send)
        elif path == "/v1/chat/completions":
            await _send(send, 200, self._completion(body))
        else:
            await _send(send, 404, {"error": {"message": "not here", "type": "NotFoundError", "code": 404}})

    def _call(self) -> dict[str, Any]:
        return {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": self.arguments}}

    def _completion(self, body: dict[str, Any]) -> dict[str, Any]:
        message = {"role": "assistant", "content": None, "tool_calls": [self._call()]}
        return {
            "id": "chatcmpl-tools",
            "object": "chat.completion",
            "created": 1,
            "model": body.get("model"),
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10},
        }

    async def _stream(self, body: dict[str, Any], send: Any) -> None:
        base = {"id": "chatcmpl-tools", "object": "chat.completion.chunk", "created": 1, "model": body.get("model")}
        size = max(1, -(-len(self.arguments) // self.pieces))
        parts = [self.arguments[i : i + size] for i in range(0, len(self.arguments), size)]
        head = {"index": 0, "id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
        deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}, {"tool_calls": [head]}]
        deltas += [{"tool_calls": [{"index": 0, "function": {"arguments": part}}]} for part in parts]
        events = [{**base, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
        events.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for event in events:
            await send(
                {"type": "http.response.body", "body": b"data: " + orjson.dumps(event) + b"\n\n", "more_body": True}
            )
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _send(send: Any, status: int, obj: Any) -> None:
    body = orjson.dumps(obj)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
