"""The same cases against both implementations of ``gateway.infra.http_api.HttpClient``: the hand-written
``http1`` (httptools) and ``http_aiohttp`` (aiohttp's client session, the library it replaces), over real
sockets to a scripted server. Every case must give the same result for both: framing (content-length,
chunked, large, streamed), the pool (reuse, limits, concurrency, connections the server closes) and
every failure (refused, connect/first-byte/idle timeouts, reset or cut mid-body, garbage)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest

from gateway.infra.http1 import Http1Client
from gateway.infra.http_aiohttp import AiohttpClient
from gateway.infra.http_api import ConnectTimeout, HttpClient, HttpResponse, ProtocolError
from tests.support.fakes import free_port
from tests.support.faults import unaccepting_port
from tests.support.scripted_http import ScriptedHTTPServer, pattern

BASE = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
IMPLEMENTATIONS = {"http1": Http1Client, "aiohttp": AiohttpClient}
IDLE_S = 0.3  # short bounds on purpose; the server's stalls are far longer, so a loaded machine cannot flip them


def make(kind: str, limit: int = 64, limit_per_host: int = 16, keepalive_s: float = 30.0) -> HttpClient:
    return IMPLEMENTATIONS[kind](base_headers=BASE, limit=limit, limit_per_host=limit_per_host, keepalive_s=keepalive_s)


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
async def client(request: pytest.FixtureRequest) -> AsyncIterator[HttpClient]:
    http = make(request.param)
    yield http
    await http.aclose()


@pytest.fixture
async def server() -> AsyncIterator[ScriptedHTTPServer]:
    async with ScriptedHTTPServer() as running:
        yield running


async def post(client: HttpClient, url: str, body: bytes = b"{}", **headers: str) -> HttpResponse:
    return await client.post(url, body, headers or None, connect_timeout_s=2.0)


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    """Poll ``predicate`` (server state) until it holds, within a bound."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return
        assert time.monotonic() < deadline, f"not in time: {what}"
        await asyncio.sleep(0.01)


# -- framing ----------------------------------------------------------------------------------------


async def test_a_content_length_body_is_read_whole_with_its_status_and_headers(
    client: HttpClient, server: ScriptedHTTPServer
) -> None:
    response = await post(client, server.url + "/echo", b'{"x": 1}', **{"X-Trace": "t-1"})
    assert response.status == 200
    assert response.header("content-type") == "application/json"
    assert response.header("x-absent") is None
    assert await response.read(IDLE_S) == b'{"x": 1}'
    seen = server.seen[0]
    assert (seen["content-type"], seen["accept"], seen["x-trace"]) == (BASE["Content-Type"], BASE["Accept"], "t-1")
    assert seen["content-length"] == "8" and seen["host"] == f"127.0.0.1:{server.port}"
    assert server.requests == ["POST /echo"]


@pytest.mark.parametrize("read", ["read", "chunk", "relay"])
async def test_a_chunked_body_is_reassembled_by_every_reader(
    client: HttpClient, server: ScriptedHTTPServer, read: str
) -> None:
    response = await post(client, server.url + "/chunked?n=4&size=7")
    assert response.status == 200 and response.header("transfer-encoding") == "chunked"
    assert await body_of(response, read) == b"a" * 7 + b"b" * 7 + b"c" * 7 + b"d" * 7


@pytest.mark.parametrize("read", ["read", "chunk", "relay"])
async def test_a_large_body_arrives_whole_and_in_order(
    client: HttpClient, server: ScriptedHTTPServer, read: str
) -> None:
    size = 8 * 1024 * 1024 + 17  # past both clients' buffers and high-water marks
    response = await post(client, server.url + f"/large?size={size}")
    assert await body_of(response, read) == pattern(size)


async def test_a_large_request_body_is_sent_whole(client: HttpClient, server: ScriptedHTTPServer) -> None:
    body = pattern(3 * 1024 * 1024)
    assert await (await post(client, server.url + "/echo", body)).read(IDLE_S) == body


async def test_a_stream_is_handed_out_before_it_ends(client: HttpClient, server: ScriptedHTTPServer) -> None:
    """Chunk i is only sent after the reader got chunk i-1: a client that waited for the end would hang."""
    response = await post(client, server.url + "/gated?n=4")
    got = []
    async with asyncio.timeout(10):
        while chunk := await response.chunk(5.0):
            got.append(chunk)
            server.gate.release()
    response.close()
    assert b"".join(got) == b"00010203"


async def test_relay_waits_for_a_full_sink_to_drain_and_loses_nothing(
    client: HttpClient, server: ScriptedHTTPServer
) -> None:
    size = 4 * 1024 * 1024
    received: list[bytes] = []
    drains = 0

    def sink(data: bytes) -> bool:
        received.append(data)
        return len(received) % 3 != 0  # full every third piece

    async def drained() -> None:
        nonlocal drains
        drains += 1
        await asyncio.sleep(0.001)

    response = await post(client, server.url + f"/large?size={size}")
    await response.relay(sink, drained, 5.0)
    assert b"".join(received) == pattern(size)
    assert drains >= 1


async def test_an_error_status_is_a_response_not_a_failure(client: HttpClient, server: ScriptedHTTPServer) -> None:
    response = await post(client, server.url + "/status?code=503")
    assert response.status == 503
    assert await response.read(IDLE_S) == b'{"error": "503"}'


# -- the pool ----------------------------------------------------------------------------------------


async def test_a_connection_is_reused_once_its_body_was_read(client: HttpClient, server: ScriptedHTTPServer) -> None:
    for i in range(5):
        assert await (await post(client, server.url + "/echo", b"%d" % i)).read(IDLE_S) == b"%d" % i
    assert server.connections == 1


async def test_a_response_closed_unread_closes_its_connection(client: HttpClient, server: ScriptedHTTPServer) -> None:
    """How vLLM learns that nobody wants the rest of a generation."""
    response = await post(client, server.url + "/gated?n=3")
    assert await response.chunk(5.0) == b"00"
    response.close()
    await until(lambda: server.open == 0, "the server sees the connection closed")
    assert await (await post(client, server.url + "/echo", b"next")).read(IDLE_S) == b"next"
    assert server.connections == 2


async def test_a_connection_close_answer_is_not_reused(client: HttpClient, server: ScriptedHTTPServer) -> None:
    for _ in range(3):
        assert await (await post(client, server.url + "/close")).read(IDLE_S) == b"ok"
    assert server.connections == 3


async def test_a_kept_alive_connection_the_server_closed_while_idle_is_replaced(
    client: HttpClient, server: ScriptedHTTPServer
) -> None:
    assert await (await post(client, server.url + "/idle-close")).read(IDLE_S) == b"ok"
    await until(lambda: server.open == 0, "the server closed its side")
    await asyncio.sleep(0.05)  # the client's loop has seen the FIN
    assert await (await post(client, server.url + "/echo", b"again")).read(IDLE_S) == b"again"
    assert server.connections == 2


async def test_a_request_on_a_connection_closed_as_it_arrives_is_sent_once_more_on_a_fresh_one(
    client: HttpClient, server: ScriptedHTTPServer
) -> None:
    assert await (await post(client, server.url + "/once")).read(IDLE_S) == b"once"
    assert await (await post(client, server.url + "/once")).read(IDLE_S) == b"once"
    assert server.connections == 2 and server.requests == ["POST /once"] * 3


async def test_a_fresh_connection_closed_without_an_answer_is_a_failure_not_retried(
    client: HttpClient, server: ScriptedHTTPServer
) -> None:
    with pytest.raises(OSError):
        await post(client, server.url + "/reset-head")
    assert server.connections == 1


async def test_concurrent_requests_each_get_their_own_answer_within_the_per_host_limit(
    server: ScriptedHTTPServer, kind: str
) -> None:
    http = make(kind, limit_per_host=4)
    try:

        async def call(i: int) -> bytes:
            return await (await post(http, server.url + "/echo", b"request %d" % i)).read(IDLE_S)

        results = await asyncio.gather(*(call(i) for i in range(200)))
    finally:
        await http.aclose()
    assert results == [b"request %d" % i for i in range(200)]
    assert server.most_open <= 4 and server.connections <= 4


async def test_a_request_over_the_total_limit_waits_for_a_free_connection(
    server: ScriptedHTTPServer, kind: str
) -> None:
    http = make(kind, limit=1, limit_per_host=1)
    try:
        first = await post(http, server.url + "/gated?n=2")
        second = asyncio.ensure_future(post(http, server.url + "/echo", b"second"))
        await asyncio.sleep(0.2)
        assert not second.done()  # no second connection while the first is busy
        server.gate.release()
        assert await first.read(5.0) == b"0001"
        assert await (await second).read(IDLE_S) == b"second"
    finally:
        await http.aclose()
    assert server.most_open == 1 and server.connections == 1  # the second request reused the first's connection


async def test_a_waiter_woken_and_cancelled_passes_its_turn_to_the_next(server: ScriptedHTTPServer) -> None:
    """A request woken for a free connection but cancelled before it ran (its client left) does not take
    the wake-up with it: the next request waiting gets the connection (it used to wait for another
    release, or its bound). http1 only: aiohttp's connector loses the wake-up the same way."""
    http = make("http1", limit=1, limit_per_host=1)
    try:
        first = await post(http, server.url + "/gated?n=2")
        second = asyncio.ensure_future(post(http, server.url + "/echo", b"second"))
        third = asyncio.ensure_future(post(http, server.url + "/echo", b"third"))
        await asyncio.sleep(0.2)
        assert not second.done() and not third.done()
        server.gate.release()
        assert await first.read(5.0) == b"0001"  # its connection is free again: the second is woken
        second.cancel()  # before it ran
        answer = await asyncio.wait_for(third, 2.0)
        assert await answer.read(IDLE_S) == b"third"
    finally:
        await http.aclose()


# -- failures ----------------------------------------------------------------------------------------


async def test_a_refused_connection_is_connection_refused(client: HttpClient) -> None:
    with pytest.raises(ConnectionRefusedError):
        await post(client, f"http://127.0.0.1:{free_port()}/echo")


async def test_a_server_that_never_accepts_is_a_connect_timeout(client: HttpClient) -> None:
    with unaccepting_port() as port, pytest.raises(ConnectTimeout):
        await client.post(f"http://127.0.0.1:{port}/echo", b"{}", None, connect_timeout_s=0.2)


async def test_the_first_byte_bound_is_the_callers_and_cancelling_closes_the_connection(
    client: HttpClient, server: ScriptedHTTPServer
) -> None:
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):
            await post(client, server.url + "/slow-head?s=30")
    await until(lambda: server.closed_by_client == 1, "the server sees the abandoned connection closed")
    assert await (await post(client, server.url + "/echo", b"after")).read(IDLE_S) == b"after"


@pytest.mark.parametrize("read", ["read", "chunk", "relay"])
async def test_a_body_that_stops_arriving_is_a_timeout_after_the_idle_bound(
    client: HttpClient, server: ScriptedHTTPServer, read: str
) -> None:
    response = await post(client, server.url + "/stall?sent=100")
    with pytest.raises(TimeoutError):
        await body_of(response, read, idle_s=IDLE_S)
    response.close()
    await until(lambda: server.open == 0, "the stalled connection is closed, not pooled")


@pytest.mark.parametrize("read", ["read", "chunk", "relay"])
@pytest.mark.parametrize("path", ["/cut?sent=1000", "/reset?sent=1000", "/cut-chunked"])
async def test_a_body_cut_short_is_a_broken_connection(
    client: HttpClient, server: ScriptedHTTPServer, read: str, path: str
) -> None:
    response = await post(client, server.url + path)
    assert response.status == 200
    with pytest.raises(OSError):
        await body_of(response, read, idle_s=5.0)
    response.close()
    assert await (await post(client, server.url + "/echo", b"fresh")).read(IDLE_S) == b"fresh"


async def test_a_reset_before_the_answer_is_a_broken_connection(client: HttpClient, server: ScriptedHTTPServer) -> None:
    with pytest.raises(OSError):
        await post(client, server.url + "/reset-head")


async def test_bytes_that_are_not_http_are_a_protocol_error(client: HttpClient, server: ScriptedHTTPServer) -> None:
    with pytest.raises(ProtocolError):
        await post(client, server.url + "/garbage")
    assert await (await post(client, server.url + "/echo", b"fine")).read(IDLE_S) == b"fine"


# -- helpers -----------------------------------------------------------------------------------------


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def body_of(response: HttpResponse, read: str, idle_s: float = 5.0) -> bytes:
    """The body through one of the three readers (each must give the same bytes and failures)."""
    if read == "read":
        return await response.read(idle_s)
    parts: list[bytes] = []
    if read == "chunk":
        try:
            while chunk := await response.chunk(idle_s):
                parts.append(chunk)
        finally:
            response.close()
        return b"".join(parts)

    async def drained() -> None:
        return None

    await response.relay(lambda data: parts.append(data) is None, drained, idle_s)
    return b"".join(parts)
