"""Worker accounting cannot drift: random sequences of requests, each meeting a random run of worker
behaviours (success, refused connections, timeouts before the headers, 503s, the client's own 400, streams
cut by a reset or an idle worker and continued elsewhere, a worker's error event, a client that leaves),
driven through the real ``Proxy`` and routing plugin over an in-process fake transport. After every
request, every worker's in-flight count, routing's admission slots and the transport's open responses
are back to zero, and each request ended in exactly one way."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.ops.metrics import Metrics
from gateway.ops.settings import Settings
from gateway.pipeline.config import GatewayConfig
from gateway.pipeline.context import RequestContext
from gateway.pipeline.plugin import Plugin
from gateway.pipeline.registry import PluginRegistry
from gateway.pipeline.runtime import RuntimeHolder, RuntimeSnapshot
from gateway.pipeline.services import Services
from gateway.proxy.forward import JSONReply, Proxy, Reply
from gateway.upstream.client import UpstreamClient
from gateway.upstream.workers import WorkerTable
from gateway.wire.errors import GatewayError
from plugins.routing.telemetry import RoutingShared
from tests.support.transport import FakeTransport, Scripted, chat_answer, chat_events

WORKERS = ["http://w1", "http://w2", "http://w3"]
TEXT = "one two three four five six"

#: What one attempt on a worker does.
OUTCOMES = ["ok", "connect", "timeout", "503", "400", "reset", "idle", "error_event", "garbage"]


def script(outcome: str, stream: bool) -> Scripted:
    events = chat_events(TEXT)
    if outcome == "ok":
        return Scripted(pieces=events if stream else [chat_answer(TEXT)])
    if outcome in ("connect", "timeout", "garbage"):
        return Scripted(before=outcome)  # type: ignore[arg-type]
    if outcome in ("503", "400"):
        body = orjson.dumps({"error": {"message": "no", "type": "x", "code": int(outcome)}})
        return Scripted(status=int(outcome), pieces=[body])
    if outcome in ("reset", "idle"):
        pieces = events[:3] if stream else [chat_answer(TEXT)[:10]]
        return Scripted(pieces=pieces, after=outcome)  # type: ignore[arg-type]
    error = b'data: {"error": {"message": "boom", "type": "x", "code": 500}}\n\n'
    return Scripted(pieces=[*events[:2], error, b"data: [DONE]\n\n"])


class Watcher(Plugin):
    """Reads every chunk: its streams take the parsed relay."""

    name = "watch"

    async def on_chunk(self, ctx: RequestContext, chunk: dict[str, Any]) -> dict[str, Any] | None:
        return chunk


class Fleet:
    """The services and live snapshot of a gateway whose workers follow a queue of scripted outcomes
    (``inspected``: a plugin reads the streams, so they are parsed; else they pass through as bytes)."""

    def __init__(self, inspected: bool = False) -> None:
        self.inspected = inspected
        self.queue: deque[Scripted] = deque()
        self.transport = FakeTransport(self._answer)
        self.stream = False

    def _answer(self, url: str, body: bytes) -> Scripted:
        return self.queue.popleft() if self.queue else script("ok", self.stream)

    async def start(self) -> tuple[Services, RuntimeSnapshot]:
        config = GatewayConfig.model_validate(
            {
                "models": [{"name": "m1", "workers": WORKERS}],
                "plugins": [
                    *([{"name": "watch"}] if self.inspected else []),
                    {"name": "routing", "config": {"max_attempts": 3, "retry_budget": {"min_per_s": 1000}}},
                ],
                "upstream": {"first_byte_timeout_s": 0.05, "idle_timeout_s": 0.05, "stream_resumptions": 1},
            }
        )
        services = Services(
            Settings(),
            UpstreamClient(config.upstream, self.transport),
            WorkerTable(eject_after_failures=10**9),  # every worker stays in play
            Metrics(),
        )
        holder = RuntimeHolder(PluginRegistry({"watch": Watcher}), services)
        snapshot, _ = await holder.load(config)
        return services, snapshot


def context(snapshot: RuntimeSnapshot, stream: bool, ids: Any) -> RequestContext:
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    model = snapshot.models.resolve("m1")
    assert model is not None
    return RequestContext(
        request_id=f"r{next(ids)}",
        endpoint="chat/completions",
        path="/v1/chat/completions",
        body=body,
        raw_body=orjson.dumps(body),
        headers={},
        model=model,
        requested_model="m1",
        snapshot=snapshot,
        stream=stream,
        started=0.0,
    )


async def drain(reply: Reply, leave_after: int | None, *, gone: bool = False) -> str:
    """Read the reply as the route would; stop early when the client leaves (``gone``: before the relay
    began). How it ended."""
    if isinstance(reply, JSONReply):
        return f"json {reply.status}"
    passthrough = reply.passthrough
    chunks: AsyncIterator[bytes] | None = reply.chunks
    if chunks is None:
        assert passthrough is not None
        chunks = passthrough.chunks()
    text = b""
    try:
        if gone:
            return "gone"
        async for piece in chunks:
            text += piece
            if leave_after is not None and len(text.split(b"\n\n")) > leave_after:
                return "left"
    finally:
        with contextlib.suppress(Exception):
            await chunks.aclose()  # type: ignore[attr-defined]
        if passthrough is not None:
            passthrough.close()
    return "done" if text.endswith(b"data: [DONE]\n\n") else "cut"


async def one_request(fleet: Fleet, snapshot: RuntimeSnapshot, proxy: Proxy, case: tuple[Any, ...], ids: Any) -> str:
    stream, outcomes, leave_after, leave_before = case
    fleet.stream = stream
    fleet.queue.extend(script(o, stream) for o in outcomes)
    ctx = context(snapshot, stream, ids)
    try:
        reply = await proxy.serve(ctx)
        if leave_before:  # the client went away before the relay began
            return await drain(reply, None, gone=True)
        return await drain(reply, leave_after)
    except GatewayError as error:
        return f"error {error.status_code}"
    finally:
        ctx.finalize()
        fleet.queue.clear()


cases = st.lists(
    st.tuples(
        st.booleans(),
        st.lists(st.sampled_from(OUTCOMES), max_size=4),
        st.one_of(st.none(), st.integers(min_value=1, max_value=6)),
        st.booleans(),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.booleans(), cases)
def test_every_counter_returns_to_zero(inspected: bool, requests: list[tuple[Any, ...]]) -> None:
    async def run() -> None:
        fleet = Fleet(inspected)
        services, snapshot = await fleet.start()
        proxy = Proxy(services)
        gate = RoutingShared.of(services).gates.get("m1")
        ids = itertools.count()
        try:
            for case in requests:
                ended = await one_request(fleet, snapshot, proxy, case, ids)
                assert ended, case
                for worker in services.workers.all():
                    assert worker.in_flight == 0, (case, ended, worker.url)
                assert gate is None or gate.in_flight == 0, (case, ended)
                assert fleet.transport.open_now == 0, (case, ended)
        finally:
            await snapshot.pipeline.aclose()
            await services.upstream.aclose()

    asyncio.run(run())


@pytest.mark.parametrize("inspected", [False, True])
async def test_a_stream_cut_midway_is_continued_and_released_on_both_workers(inspected: bool) -> None:
    fleet = Fleet(inspected)
    services, snapshot = await fleet.start()
    proxy = Proxy(services)
    ended = await one_request(fleet, snapshot, proxy, (True, ["reset"], None, False), itertools.count())
    assert ended == "done"
    urls = [url for url, _ in fleet.transport.requests]
    assert len(urls) == 2 and urls[0] != urls[1]  # continued on another worker
    assert all(w.in_flight == 0 for w in services.workers.all())
    await snapshot.pipeline.aclose()
