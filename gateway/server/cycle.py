"""The ASGI side of the hot routes: the types, request ids, one request's cycle state and the senders.

``RequestCycle`` is what a handler knows about one request between its first byte and its access-log
line (status, model, whether the answer started, the disconnect watch, the context); the senders keep it
current, so the handler's ``finally`` can always tell what the client got.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from gateway.pipeline.context import RequestContext

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_JSON = (b"content-type", b"application/json")


def client_request_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    """A sane client-supplied x-request-id (short, printable, no spaces), else None."""
    for name, value in headers:
        if name == b"x-request-id":
            if 0 < len(value) <= 128 and all(33 <= b < 127 for b in value):
                return value.decode("ascii")
            break
    return None


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    """Keep a sane client-supplied x-request-id (short, printable, no spaces); otherwise make one."""
    return client_request_id(headers) or uuid.uuid4().hex


class RequestIds:
    """Request ids for the hot path: the client's when sane, else 32 hex digits unique to this process
    run (a random prefix and a counter; ``uuid4`` reads the OS random source on every request)."""

    def __init__(self) -> None:
        self._prefix = uuid.uuid4().hex[:16]
        self._counter = itertools.count(1)

    def __call__(self, headers: list[tuple[bytes, bytes]]) -> str:
        return client_request_id(headers) or f"{self._prefix}{next(self._counter):016x}"


@dataclass(slots=True, eq=False)
class RequestCycle:
    """One request's state in its handler, from the first byte to the access-log line."""

    request_id: str
    started: float
    status: int = 0  # what the client was answered (499: it went away first)
    model: str = "-"  # the model's name once resolved
    sent: bool = False  # the answer's start went out: an error now can only be an SSE event
    finished: bool = False  # the answer is complete (the disconnect watch stops caring)
    client_gone: bool = False  # the disconnect watch cancelled the handler
    error: tuple[str, str | None] | None = None  # (type, code) of the error answered, for the access log
    self_recorded: bool = False  # a handler below records its own metrics and access line (a Responses turn)
    task: asyncio.Task[Any] | None = None  # the handler's task, which the disconnect watch cancels
    watch_timer: asyncio.TimerHandle | None = None
    watcher: asyncio.Task[None] | None = None
    ctx: RequestContext | None = None


def encoded(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


async def send_json(send: Send, cycle: RequestCycle, status: int, body: bytes, headers: dict[str, str]) -> None:
    """A whole JSON reply (an answer or an error), with its length: what clients and proxies expect of
    one, rather than chunked framing."""
    cycle.status = status
    cycle.sent = True
    length = (b"content-length", b"%d" % len(body))
    head = [_JSON, length, (b"x-request-id", cycle.request_id.encode("ascii")), *encoded(headers)]
    await send({"type": "http.response.start", "status": status, "headers": head})
    cycle.finished = True
    await send({"type": "http.response.body", "body": body})
