"""A pass-through stream under uvicorn's httptools server (what ``gateway serve`` runs) is relayed from
the worker connection's reads straight to the client's connection (``gateway.infra.chunked_writer``), with
the client's backpressure reaching the worker; under any other server it goes through ASGI ``send``.
Both ways give the client the worker's bytes exactly."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httptools
import httpx
import orjson
import pytest

from gateway.infra.chunked_writer import ChunkedWriter
from gateway.pipeline.context import RequestContext
from gateway.proxy.answer import AnswerStream
from gateway.proxy.passthrough import PassThrough
from tests.proxy.test_stream_relay import Inspect
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.upstream.test_client_against_scripted_workers import client, raw_worker, serving_health

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": True}
COMMENT = b": from the worker\n\n"


@pytest.fixture
def ways(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts which way each pass-through stream was relayed."""
    used = {"direct": 0, "send": 0}
    relay, chunks = PassThrough.relay, PassThrough.chunks

    async def counted_relay(self: PassThrough, writer: ChunkedWriter) -> None:
        used["direct"] += 1
        await relay(self, writer)

    def counted_chunks(self: PassThrough) -> Any:
        used["send"] += 1
        return chunks(self)

    monkeypatch.setattr(PassThrough, "relay", counted_relay)
    monkeypatch.setattr(PassThrough, "chunks", counted_chunks)
    return used


def stream_body(url: str) -> bytes:
    with httpx.stream("POST", url + "/v1/chat/completions", json=CHAT, timeout=10) as response:
        assert response.status_code == 200
        return response.read()


@pytest.mark.parametrize("http", ["gateway", "httptools", "h11"])
def test_a_pass_through_stream_arrives_byte_for_byte_either_way(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, ways: dict[str, int], http: str
) -> None:
    upstream.behavior.preamble = COMMENT
    upstream.behavior.chunks = 5
    with gateway_factory(base_config([upstream_url]), http=http) as (_, server):
        body = stream_body(server.url)
        direct = stream_body(upstream_url)
    assert body == direct  # the worker's own bytes, its SSE comment included
    assert body.startswith(COMMENT) and body.endswith(b"data: [DONE]\n\n")
    # The fallback (PassThrough.chunks) is made only when the direct relay cannot be used.
    if http in ("gateway", "httptools"):
        assert ways["direct"] == 1
    else:
        assert ways == {"direct": 0, "send": 1}


def test_a_cut_stream_relayed_directly_ends_with_one_error_event(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, ways: dict[str, int]
) -> None:
    upstream.behavior.cut_after = 2
    with gateway_factory(base_config([upstream_url])) as (_, server):
        body = stream_body(server.url).decode()
    assert ways["direct"] == 1
    assert body.count('"error"') == 1 and body.endswith("data: [DONE]\n\n")


# -- what the writer is offered for ---------------------------------------------------------------


def test_the_writer_is_offered_only_mid_way_through_a_chunked_uvicorn_response() -> None:
    seen: dict[str, Any] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        chunked = scope["path"] == "/chunked"
        seen[f"{scope['path']} before start"] = ChunkedWriter.of(send)
        headers = [] if chunked else [(b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        writer = seen[f"{scope['path']} after start"] = ChunkedWriter.of(send)
        if writer is not None:
            assert writer.write(b"ok")
            await writer.drained()
            await send({"type": "http.response.body", "body": b""})
        else:
            await send({"type": "http.response.body", "body": b"ok"})
        seen[f"{scope['path']} after end"] = ChunkedWriter.of(send)

    with ServerThread(app, lifespan="off") as server:
        assert httpx.get(server.url + "/chunked").content == b"ok"
        assert httpx.get(server.url + "/sized").content == b"ok"
    assert isinstance(seen["/chunked after start"], ChunkedWriter)
    others = {k: v for k, v in seen.items() if k != "/chunked after start"}
    assert others and all(v is None for v in others.values())
    assert ChunkedWriter.of(lambda message: asyncio.sleep(0)) is None  # not a server's send at all


# -- backpressure: a client that stops reading stops the worker ------------------------------------

RAW_PIECE = b"data: " + b"x" * (32 * 1024 - 8) + b"\n\n"  # passed through as bytes
JSON_PIECE = b'data: {"choices":[{"index":0,"delta":{"content":"%s"},"finish_reason":null}]}\n\n' % (b"x" * 32_000)
LAST = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
PIECES = 2048  # about 64 MiB in all, far beyond every buffer on the way


@contextlib.contextmanager
def fast_worker(progress: dict[str, int], piece: bytes) -> Iterator[str]:
    """A worker that writes a ~64 MiB stream as fast as the gateway takes it, counting what it wrote."""

    def answer(conn: socket.socket, head: bytes) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(PIECES):
            conn.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            progress["sent"] += len(piece)
        conn.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(LAST), LAST))
        return True

    with raw_worker(serving_health(answer)) as worker:
        yield worker.url


def held_at_most() -> int:
    """How much the worker may have written while the client reads nothing, when the gateway holds it
    back: what the kernel may buffer on the way (the worker's send buffer and the gateway's to the
    client, each up to tcp_wmem's maximum; the gateway's receive buffer from the worker, autotuned up to
    tcp_rmem's maximum, 32 MiB on some machines) and 8 MiB for the relay's own reads and writes; at
    least the 24 MiB this test allowed before it read the kernel's limits."""
    try:
        rmem = int(Path("/proc/sys/net/ipv4/tcp_rmem").read_text().split()[2])
        wmem = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, IndexError, ValueError):
        return 24 * 1024 * 1024
    return max(24 * 1024 * 1024, rmem + 2 * wmem + 8 * 1024 * 1024)


@pytest.mark.parametrize("relay", ["bytes", "parsed"])
def test_a_client_that_stops_reading_holds_the_worker_back(
    gateway_factory: GatewayFactory, ways: dict[str, int], relay: str
) -> None:
    progress = {"sent": 0}
    piece = RAW_PIECE if relay == "bytes" else JSON_PIECE
    bound = held_at_most()
    if bound >= PIECES * len(piece):
        pytest.skip(f"this machine's socket buffers ({bound} bytes) hold the whole stream")
    plugins = [{"name": "routing"}] if relay == "bytes" else [{"name": "inspect"}, {"name": "routing"}]
    with (
        fast_worker(progress, piece) as worker_url,
        gateway_factory(base_config([worker_url], plugins=plugins), plugins={"inspect": Inspect}) as (_, server),
    ):
        body = b'{"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": true}'
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        deadline = time.monotonic() + 10
        while progress["sent"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.5)  # the client reads nothing meanwhile
        held_at = progress["sent"]
        received = bytearray()
        reader = threading.Thread(target=_read_all, args=(sock, received), daemon=True)
        reader.start()
        reader.join(timeout=60)
    assert ways["direct"] == (1 if relay == "bytes" else 0)
    # Without backpressure the gateway would have taken all 64 MiB into its memory by now; what the
    # worker got rid of is bounded by the socket buffers between the two ends.
    assert 0 < held_at < bound
    assert progress["sent"] == PIECES * len(piece)  # and it all flowed once the client read again
    relayed = _body_of(bytes(received))
    if relay == "bytes":
        assert relayed == RAW_PIECE * PIECES + LAST
    else:
        events = [e for e in relayed.split(b"\n\n") if e]
        assert len(events) == PIECES + 2 and events[-1] == b"data: [DONE]"
        assert all(orjson.loads(e[6:])["choices"][0]["delta"]["content"] == "x" * 32_000 for e in events[:PIECES])


def test_a_parsed_stream_writes_what_one_read_brought_as_one_piece(
    gateway_factory: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    event = b'data: {"choices":[{"index":0,"delta":{"content":"%d"},"finish_reason":null}]}\n\n'
    burst = b"".join(event % i for i in range(1, 6))

    def first_then_burst(conn: socket.socket, head: bytes) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        first = event % 0
        conn.sendall(b"%x\r\n%s\r\n" % (len(first), first))
        time.sleep(0.2)
        rest = burst + LAST
        conn.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(rest), rest))
        return True

    written: list[bytes] = []
    write = ChunkedWriter.write

    def recorded(self: ChunkedWriter, data: bytes) -> bool:
        written.append(data)
        return write(self, data)

    monkeypatch.setattr(ChunkedWriter, "write", recorded)
    plugins = [{"name": "inspect"}, {"name": "routing"}]
    with (
        raw_worker(serving_health(first_then_burst)) as worker,
        gateway_factory(base_config([worker.url], plugins=plugins), plugins={"inspect": Inspect}) as (_, server),
    ):
        body = stream_body(server.url)
    assert body.endswith(b"data: [DONE]\n\n")
    contents = [
        [orjson.loads(e[6:])["choices"][0]["delta"].get("content") for e in w.split(b"\n\n") if e[6:7] == b"{"]
        for w in written
    ]
    assert ["0"] in contents and ["1", "2", "3", "4", "5", None] in contents  # the burst: one write


def _body_of(response: bytes) -> bytes:
    """The body of one chunked HTTP/1.1 response, de-framed."""
    parts: list[bytes] = []

    class Callbacks:
        def on_body(self, body: bytes) -> None:
            parts.append(body)

    httptools.HttpResponseParser(Callbacks()).feed_data(response)
    return b"".join(parts)


def _read_all(sock: socket.socket, into: bytearray) -> None:
    with sock:
        while not into.endswith(b"\r\n0\r\n\r\n"):
            data = sock.recv(1 << 20)
            if not data:
                return
            into += data


# -- the upstream connection's relay mode ----------------------------------------------------------


EVENTS = [b'data: {"n": %d}\n\n' % i for i in range(4)] + [b"data: [DONE]\n\n"]


def paced_stream(gap_s: float) -> Any:
    def answer(conn: socket.socket, head: bytes) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for event in EVENTS:
            conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
            time.sleep(gap_s)
        conn.sendall(b"0\r\n\r\n")
        return True

    return answer


async def test_relay_hands_each_read_to_the_sink_and_keeps_the_connection() -> None:
    upstream = client()
    with raw_worker(paced_stream(0.02)) as worker:
        response = await upstream.open(worker.url, "/v1/chat/completions", b"{}")
        pieces: list[bytes] = []
        await response.relay(lambda piece: pieces.append(piece) is None, asyncio.sleep)
        assert b"".join(pieces) == b"".join(EVENTS) and len(pieces) >= 3
        again = await upstream.open(worker.url, "/v1/chat/completions", b"{}")
        await again.read()
    assert worker.connections == 1  # read to the end: the connection went back to the pool
    await upstream.aclose()


async def test_a_full_sink_pauses_the_worker_until_drained() -> None:
    upstream = client()
    with raw_worker(paced_stream(0.01)) as worker:
        response = await upstream.open(worker.url, "/v1/chat/completions", b"{}")
        pieces: list[bytes] = []
        drains = 0

        async def drained() -> None:
            nonlocal drains
            drains += 1
            await asyncio.sleep(0.05)

        await response.relay(lambda piece: pieces.append(piece) is not None, drained)  # always "full"
    assert b"".join(pieces) == b"".join(EVENTS)
    assert drains >= 1
    await upstream.aclose()


async def test_a_sink_that_fails_ends_the_response_and_drops_the_connection() -> None:
    upstream = client()

    def broken(piece: bytes) -> bool:
        raise RuntimeError("the client side broke")

    with raw_worker(paced_stream(0.01)) as worker:
        response = await upstream.open(worker.url, "/v1/chat/completions", b"{}")
        with pytest.raises(RuntimeError, match="client side broke"):
            await response.relay(broken, asyncio.sleep)
        again = await upstream.open(worker.url, "/v1/chat/completions", b"{}")
        await again.read()
    assert worker.connections == 2  # the broken one was not reused
    await upstream.aclose()


async def test_what_was_buffered_before_the_relay_began_goes_first() -> None:
    upstream = client()
    with raw_worker(paced_stream(0.0)) as worker:
        response = await upstream.open(worker.url, "/v1/chat/completions", b"{}")
        await asyncio.sleep(0.2)  # the whole body is buffered by now
        pieces: list[bytes] = []
        await response.relay(lambda piece: pieces.append(piece) is None, asyncio.sleep)
    assert b"".join(pieces) == b"".join(EVENTS)
    await upstream.aclose()


async def test_closing_a_stream_that_was_never_relayed_releases_the_worker_once() -> None:
    from gateway.ops.metrics import Metrics

    upstream = client()
    ends: list[bool] = []
    with raw_worker(paced_stream(0.2)) as worker:
        response = await upstream.open(worker.url, "/v1/chat/completions", b"{}")
        ctx: Any = RequestContext.__new__(RequestContext)
        stream = PassThrough(ctx, AnswerStream(response, None), Metrics(), ends.append)
        stream.close()
        stream.close()
        for _ in range(250):  # bounded: 5 s
            if not worker.open_now:
                break
            await asyncio.sleep(0.02)
        # The unread stream's connection was closed under the worker (which makes vLLM abort it); a
        # stream read to the end would have stayed open for the next request.
        assert worker.open_now == 0
    assert ends == [False]
    await upstream.aclose()
