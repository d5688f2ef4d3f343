"""The upstream client and its HTTP/1.1 pool against scripted workers on real sockets: what a worker may
send that is not a clean response (garbage, a cut body, a stall, chunked framing, an error event in a
stream), the pool's limits, reuse and eviction, and connect timeouts; through the gateway where the
client-visible error matters, directly on ``UpstreamClient`` where the contract is the client's."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.pipeline.context import RequestContext
from gateway.pipeline.plugin import Plugin
from gateway.upstream.client import UpstreamClient, UpstreamConfig, UpstreamFailure
from tests.support.faults import error_events, sse_events, unaccepting_port
from tests.support.gateways import GatewayFactory, base_config
from tests.wire.test_error_shape import CHAT, assert_error_shape

Answer = Callable[[socket.socket, bytes], bool]  # (connection, request head) -> keep the connection open


def _read_request(conn: socket.socket) -> bytes | None:
    """One request (head and content-length body); None when the peer closed first."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = conn.recv(65536)
        if not piece:
            return None
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")),
        0,
    )
    while len(body) < length:
        piece = conn.recv(65536)
        if not piece:
            return None
        body += piece
    return head


class RawWorker:
    """A TCP server on threads that answers each request with ``answer(conn, head)`` (raw bytes)."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.heads: list[bytes] = []
        self.connections = 0
        self.open_now = 0
        self.most_open = 0
        self.closed_by_client = 0
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                self.open_now += 1
                self.most_open = max(self.most_open, self.open_now)
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                head = _read_request(conn)
                if head is None:
                    with self._lock:
                        self.closed_by_client += 1
                    return
                self.heads.append(head)
                if not self.answer(conn, head):
                    return
        except OSError:
            return
        finally:
            with self._lock:
                self.open_now -= 1
            conn.close()

    def close(self) -> None:
        self.sock.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.close()


@contextlib.contextmanager
def raw_worker(answer: Answer) -> Iterator[RawWorker]:
    worker = RawWorker(answer)
    try:
        yield worker
    finally:
        worker.close()


def json_answer(body: bytes, *, delay_s: float = 0.0, close: bool = False) -> Answer:
    def answer(conn: socket.socket, head: bytes) -> bool:
        if delay_s:
            time.sleep(delay_s)
        connection = b"close" if close else b"keep-alive"
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: %s\r\nContent-Length: %d\r\n\r\n%s"
            % (connection, len(body), body)
        )
        return not close

    return answer


def send_then_close(data: bytes, *, after_s: float) -> Answer:
    """Send ``data`` (an unfinished response), wait ``after_s``, then close the connection."""

    def answer(conn: socket.socket, head: bytes) -> bool:
        conn.sendall(data)
        time.sleep(after_s)
        return False

    return answer


def serving_health(answer: Answer) -> Answer:
    """``answer`` for requests, and a plain 200 for the gateway's health checks (GET /health)."""

    def with_health(conn: socket.socket, head: bytes) -> bool:
        if head.startswith(b"GET /health "):
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            return True
        return answer(conn, head)

    return with_health


async def until(predicate: Callable[[], bool], timeout_s: float = 2.0) -> None:
    """Poll ``predicate`` (state changed by a server thread) until it holds, within a bound."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


COMPLETION = orjson.dumps(
    {
        "id": "c",
        "object": "chat.completion",
        "created": 1,
        "model": "m1",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    }
)


def client(**config: Any) -> UpstreamClient:
    """An upstream client; tests of the idle bound set a short one themselves (a loaded machine can hold
    a fake worker's thread up for longer than a short bound, which must not fail the other tests)."""
    return UpstreamClient(
        UpstreamConfig(**{"connect_timeout_s": 1, "first_byte_timeout_s": 2, "idle_timeout_s": 5, **config})
    )


# -- the client's contract ------------------------------------------------------------------------


async def test_a_worker_that_answers_garbage_is_a_protocol_failure_not_retried() -> None:
    def garbage(conn: socket.socket, head: bytes) -> bool:
        conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        return True

    upstream = client()
    with raw_worker(garbage) as worker, pytest.raises(UpstreamFailure) as failed:
        await upstream.open(worker.url, "/v1/chat/completions", b"{}")
    assert (failed.value.kind, failed.value.retryable) == ("protocol", False)
    assert failed.value.error.status_code == 502 and failed.value.error.code == "upstream_error"
    await upstream.aclose()


async def test_request_head_names_the_host_the_path_prefix_and_extra_headers() -> None:
    upstream = client()
    with raw_worker(json_answer(COMPLETION)) as worker:
        response = await upstream.open(
            worker.url + "/prefix/", "/v1/chat/completions", b'{"a":1}', headers={"traceparent": "00-abc-def-01"}
        )
        assert response.status == 200 and response.content_type == "application/json"
        assert await response.read() == COMPLETION
    lines = worker.heads[0].split(b"\r\n")
    assert lines[0] == b"POST /prefix/v1/chat/completions HTTP/1.1"
    assert f"Host: 127.0.0.1:{worker.port}".encode() in lines
    assert b"Content-Length: 7" in lines and b"traceparent: 00-abc-def-01" in lines
    await upstream.aclose()


async def test_chunked_responses_are_reassembled() -> None:
    def chunked(conn: socket.socket, head: bytes) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in (COMPLETION[:10], COMPLETION[10:]):
            conn.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            time.sleep(0.01)
        conn.sendall(b"0\r\n\r\n")
        return True

    upstream = client()
    with raw_worker(chunked) as worker:
        response = await upstream.open(worker.url, "/v1/chat/completions", b"{}")
        assert response.content_type == ""  # the worker sent none
        assert await response.read() == COMPLETION
        again = await upstream.open(worker.url, "/v1/chat/completions", b"{}")  # the same connection, reused
        assert await again.read() == COMPLETION
    assert worker.connections == 1
    await upstream.aclose()


async def test_a_body_that_stops_arriving_is_a_timeout_after_the_idle_bound() -> None:
    stall = send_then_close(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"partial":', after_s=5.0)
    upstream = client(idle_timeout_s=0.2)
    with raw_worker(stall) as worker:
        response = await upstream.open(worker.url, "/v1/chat/completions", b"{}")
        with pytest.raises(UpstreamFailure) as failed:
            await response.read()
    # a timeout, not the broken connection the worker causes later: the idle bound fired first
    assert failed.value.kind == "timeout" and failed.value.error.status_code == 504
    assert "stopped sending" in failed.value.error.message
    await upstream.aclose()


@pytest.mark.parametrize("streamed", [False, True], ids=["read", "iter_chunks"])
async def test_a_body_cut_by_a_closed_connection_is_a_broken_connection(streamed: bool) -> None:
    cut = send_then_close(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10, after_s=0.05)
    upstream = client()
    with raw_worker(cut) as worker:
        response = await upstream.open(worker.url, "/v1/chat/completions", b"{}")
        with pytest.raises(UpstreamFailure) as failed:
            if streamed:
                async for _ in response.iter_chunks():
                    pass
            else:
                await response.read()
    assert failed.value.kind == "protocol" and failed.value.error.code == "upstream_error"
    assert "connection to the model worker broke" in failed.value.error.message
    await upstream.aclose()


async def test_a_stream_that_goes_quiet_is_a_timeout_on_iteration() -> None:
    quiet_stream = send_then_close(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\ndata:\r\n", after_s=5.0)
    upstream = client(idle_timeout_s=0.2)
    with raw_worker(quiet_stream) as worker:
        response = await upstream.open(worker.url, "/v1/chat/completions", b"{}")
        received: list[bytes] = []
        with pytest.raises(UpstreamFailure) as failed:
            async for chunk in response.iter_chunks():
                received.append(chunk)
    assert received == [b"data:"]
    assert failed.value.kind == "timeout"
    await upstream.aclose()


async def test_connection_close_responses_are_not_kept_for_reuse() -> None:
    upstream = client()
    with raw_worker(json_answer(COMPLETION, close=True)) as worker:
        for _ in range(3):
            response = await upstream.open(worker.url, "/v1/chat/completions", b"{}")
            assert await response.read() == COMPLETION
    assert worker.connections == 3
    await upstream.aclose()


async def test_a_slow_reader_still_gets_every_byte_of_a_large_body() -> None:
    body = bytes(range(256)) * (3 * 4096 + 17)  # about 3 MiB: more than the pool buffers before pausing

    def large(conn: socket.socket, head: bytes) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        return True

    upstream = client(idle_timeout_s=2)
    with raw_worker(large) as worker:
        response = await upstream.open(worker.url, "/v1/completions", b"{}")
        await asyncio.sleep(0.2)  # let the socket fill the connection's buffer
        received = bytearray()
        async for chunk in response.iter_chunks():
            received += chunk
            await asyncio.sleep(0)
    assert bytes(received) == body
    await upstream.aclose()


# -- the pool -------------------------------------------------------------------------------------


async def test_requests_over_the_per_worker_limit_wait_for_a_connection() -> None:
    upstream = client(max_connections_per_worker=1, first_byte_timeout_s=5)
    with raw_worker(json_answer(COMPLETION, delay_s=0.1)) as worker:

        async def call() -> bytes:
            response = await upstream.open(worker.url, "/v1/chat/completions", b"{}")
            return await response.read()

        assert await asyncio.gather(*(call() for _ in range(4))) == [COMPLETION] * 4
    assert worker.most_open == 1 and worker.connections == 1
    await upstream.aclose()


async def test_at_the_total_limit_an_idle_connection_to_another_worker_gives_way() -> None:
    upstream = client(max_connections=1)
    with raw_worker(json_answer(COMPLETION)) as first, raw_worker(json_answer(COMPLETION)) as second:
        assert await (await upstream.open(first.url, "/v1/chat/completions", b"{}")).read() == COMPLETION
        assert await (await upstream.open(second.url, "/v1/chat/completions", b"{}")).read() == COMPLETION
        await until(lambda: first.closed_by_client == 1)  # its idle connection was closed to make room
        assert await (await upstream.open(second.url, "/v1/chat/completions", b"{}")).read() == COMPLETION
        assert second.connections == 1  # ... while the new one is kept and reused
    await upstream.aclose()


async def test_a_worker_that_never_accepts_is_a_connect_timeout() -> None:
    upstream = client(connect_timeout_s=0.2)
    try:
        with unaccepting_port() as port, pytest.raises(UpstreamFailure) as failed:
            await upstream.open(f"http://127.0.0.1:{port}", "/v1/chat/completions", b"{}")
    finally:
        await upstream.aclose()
    assert (failed.value.kind, failed.value.retryable) == ("connect", True)
    assert "ConnectTimeout" in failed.value.error.message and failed.value.error.status_code == 503


async def test_an_https_worker_that_speaks_plain_http_cannot_be_reached() -> None:
    upstream = client()
    with raw_worker(json_answer(COMPLETION)) as worker, pytest.raises(UpstreamFailure) as failed:
        await upstream.open(f"https://127.0.0.1:{worker.port}", "/v1/chat/completions", b"{}")
    assert failed.value.kind == "connect" and failed.value.error.status_code == 503
    await upstream.aclose()


# -- what the client sees through the gateway ------------------------------------------------------


def test_a_200_that_is_not_json_is_a_502(gateway_factory: GatewayFactory) -> None:
    with (
        raw_worker(serving_health(json_answer(b"<html>maintenance</html>"))) as worker,
        gateway_factory(base_config([worker.url])) as (_, server),
    ):
        error = assert_error_shape(httpx.post(server.url + "/v1/chat/completions", json=CHAT), 502)
        assert error["code"] == "upstream_error" and "not JSON" in error["message"]


def test_a_worker_speaking_garbage_is_a_502_upstream_error(gateway_factory: GatewayFactory) -> None:
    def garbage(conn: socket.socket, head: bytes) -> bool:
        conn.sendall(b"\x00\x01\x02 not http at all\r\n\r\n")
        return False

    with raw_worker(serving_health(garbage)) as worker, gateway_factory(base_config([worker.url])) as (_, server):
        error = assert_error_shape(httpx.post(server.url + "/v1/chat/completions", json=CHAT), 502)
        assert error["code"] == "upstream_error"


class ChunkWatcher(Plugin):
    """Makes the core parse streams chunk by chunk (any on_chunk override does)."""

    name = "chunk_watcher"

    async def on_chunk(self, ctx: RequestContext, chunk: dict[str, Any]) -> dict[str, Any] | None:
        return chunk


def _sse_answer(events: list[bytes]) -> Answer:
    def answer(conn: socket.socket, head: bytes) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for event in events:
            conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
        conn.sendall(b"0\r\n\r\n")
        return True

    return answer


FIRST = (
    b"data: "
    + orjson.dumps(
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m1",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "finish_reason": None}],
        }
    )
    + b"\n\n"
)


def test_an_error_event_inside_an_inspected_stream_is_translated_and_ends_it(gateway_factory: GatewayFactory) -> None:
    worker_error = b'data: {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}\n\n'
    config = base_config([], plugins=[{"name": "chunk_watcher"}, {"name": "routing"}])
    with raw_worker(serving_health(_sse_answer([FIRST, worker_error, b"data: [DONE]\n\n"]))) as worker:
        config["models"][0]["workers"] = [worker.url]
        with gateway_factory(config, plugins={"chunk_watcher": ChunkWatcher}) as (_, server):
            response = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status_code == 200
    events = sse_events(response.text)
    assert orjson.loads(events[0])["choices"][0]["delta"]["content"] == "Hi"
    errors = error_events(events)
    assert len(errors) == 1 and errors[0]["type"] == "server_error" and "engine died" in errors[0]["message"]
    assert events[-1] == b"[DONE]"


def test_an_event_that_is_not_json_ends_an_inspected_stream_with_a_502_event(gateway_factory: GatewayFactory) -> None:
    config = base_config([], plugins=[{"name": "chunk_watcher"}, {"name": "routing"}])
    with raw_worker(serving_health(_sse_answer([FIRST, b"data: {not json\n\n", b"data: [DONE]\n\n"]))) as worker:
        config["models"][0]["workers"] = [worker.url]
        with gateway_factory(config, plugins={"chunk_watcher": ChunkWatcher}) as (_, server):
            response = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "stream": True})
    errors = error_events(sse_events(response.text))
    assert [e["code"] for e in errors] == ["upstream_error"]
    assert "not JSON" in errors[0]["message"]
