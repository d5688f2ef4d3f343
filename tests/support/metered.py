"""A fake OpenAI worker that meters what it generates and sends, per request, for billing tests.

Each request names itself and its fate in its prompt's words, so a test drives many of them at once:
``rid-7`` (its id), ``len-23`` (tokens per choice before max_tokens and the context cap),
``fault-500`` / ``fault-503`` (answer that status), ``cut-4`` (a stream's connection ends after 4 token
events). Its tokenizer is deliberately not the gateway's estimate: one token per prompt word plus 4
per message. A stream sends one event per token per choice (as vLLM does), every ``pace_s``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass
class Metered:
    """What the fake did for one request."""

    prompt: int = 0
    generated: int = 0  # completion tokens the worker produced (the usage it reports when it finishes)
    sent: int = 0  # token events written to the connection
    finished: bool = False


@dataclass
class MeteredWorker:
    context: int = 128
    pace_s: float = 0.002
    seen: dict[str, Metered] = field(default_factory=dict)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].rsplit(".", 1)[-1]
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if scope["path"] == "/health":
            await _json(send, 200, {})
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        body = orjson.loads(raw)
        words = " ".join(str(m.get("content", "")) for m in body["messages"]).split()
        tags = dict(w.split("-", 1) for w in words if "-" in w)
        meter = self.seen[tags["rid"]] = Metered(prompt=len(words) + 4 * len(body["messages"]))
        if "fault" in tags:
            await _json(send, int(tags["fault"]), {"object": "error", "message": "fake fault", "code": 500})
            return
        n = body.get("n") or 1
        limit = body.get("max_tokens") or body.get("max_completion_tokens") or self.context
        length = max(1, min(int(tags.get("len", 8)), limit, self.context - meter.prompt))
        finish = "length" if length == limit else "stop"
        if not body.get("stream"):
            meter.generated = meter.sent = n * length
            meter.finished = True
            choices = [
                {"index": i, "message": {"role": "assistant", "content": "tok " * length}, "finish_reason": finish}
                for i in range(n)
            ]
            usage = {"prompt_tokens": meter.prompt, "completion_tokens": n * length}
            await _json(
                send,
                200,
                {
                    "id": "x",
                    "object": "chat.completion",
                    "created": 1,
                    "model": body["model"],
                    "choices": choices,
                    "usage": {**usage, "total_tokens": sum(usage.values())},
                },
            )
            return
        cut = int(tags["cut"]) if "cut" in tags else None
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        base = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": body["model"]}

        async def event(choices: list[dict[str, Any]], **extra: Any) -> None:
            payload = orjson.dumps({**base, "choices": choices, **extra})
            await send({"type": "http.response.body", "body": b"data: " + payload + b"\n\n", "more_body": True})

        for i in range(n):
            await event([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        for _ in range(length):
            for i in range(n):
                if cut is not None and meter.sent >= cut:
                    return  # the connection ends without [DONE]
                meter.generated += 1
                await event([{"index": i, "delta": {"content": "tok "}, "finish_reason": None}])
                meter.sent += 1
            await asyncio.sleep(self.pace_s)
        for i in range(n):
            await event([{"index": i, "delta": {}, "finish_reason": finish}])
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": meter.prompt, "completion_tokens": meter.generated}
            await event([], usage={**usage, "total_tokens": sum(usage.values())})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        meter.finished = True


async def _json(send: Any, status: int, obj: Any) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": orjson.dumps(obj)})
