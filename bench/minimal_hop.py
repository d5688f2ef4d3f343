"""The floor a Python gateway stands on: uvicorn (uvloop, httptools) + one pooled aiohttp session,
bytes in, bytes out, no parsing, no plugins, no metrics, no logs. A peer in the benchmark so the
gateway's own cost is visible as the difference.

    UPSTREAM=http://127.0.0.1:9100 uvicorn --factory bench.minimal_hop:create_app --port 9200
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import aiohttp

Message = MutableMapping[str, Any]


def create_app() -> Callable[..., Awaitable[None]]:
    upstream = os.environ.get("UPSTREAM", "http://127.0.0.1:9100")
    holder: dict[str, aiohttp.ClientSession] = {}

    async def app(scope: Message, receive: Callable[[], Awaitable[Message]], send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    connector = aiohttp.TCPConnector(limit=2048, limit_per_host=512)
                    holder["s"] = aiohttp.ClientSession(connector=connector, auto_decompress=False)
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await holder["s"].close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        headers = {"content-type": "application/json"}
        async with holder["s"].request(scope["method"], upstream + scope["path"], data=body, headers=headers) as resp:
            ctype = resp.headers.get("content-type", "application/json").encode()
            await send({"type": "http.response.start", "status": resp.status, "headers": [(b"content-type", ctype)]})
            async for chunk in resp.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

    return app
