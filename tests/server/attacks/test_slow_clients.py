"""Slow and idle clients: slow headers (slowloris), a slow body, connections that never send a request,
and idle keep-alive connections. Each is cut at its deadline while a normal client is served."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.server.attacks.raw import (
    closed_by_server,
    connect,
    error_of,
    head,
    read_response,
    read_until_closed,
    responses,
    served,
)
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config

# Deadlines short enough for a test; the defaults are 15 s (first request), 30 s (head), 60 s (body).
TIMEOUTS = {"first_request_timeout_s": 1.0, "header_timeout_s": 1.0, "body_timeout_s": 1.0, "keepalive_timeout_s": 1}


@pytest.fixture
def strict(gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str) -> Iterator[ServerThread]:
    with gateway_factory(base_config([upstream_url]), **TIMEOUTS) as (_, server):
        yield server


@contextlib.contextmanager
def sockets(port: int, count: int) -> Iterator[list[socket.socket]]:
    opened = [connect(port) for _ in range(count)]
    try:
        yield opened
    finally:
        for sock in opened:
            sock.close()


def test_a_slow_head_is_408_at_its_deadline(strict: ServerThread, upstream: FakeUpstream) -> None:
    with connect(strict.port) as sock:
        started = time.monotonic()
        sock.sendall(head() + b"X-Slow: ")
        answered = threading.Event()

        def trickle() -> None:  # one byte every 0.2 s: each read is in time, the head never is
            with contextlib.suppress(OSError):
                while not answered.is_set():
                    sock.sendall(b"a")
                    time.sleep(0.2)

        feeder = threading.Thread(target=trickle, daemon=True)
        feeder.start()
        served(strict)  # meanwhile
        answer = read_until_closed(sock, timeout=10)
        answered.set()
        elapsed = time.monotonic() - started
    error = error_of(answer, 408)
    assert error["code"] == "request_timeout" and "headers" in str(error["message"])
    assert 0.9 <= elapsed < 8
    assert len(upstream.requests) == 1  # only the normal client's


def test_a_slowloris_crowd_is_cut_and_others_are_served(strict: ServerThread, upstream: FakeUpstream) -> None:
    with sockets(strict.port, 200) as crowd:
        for sock in crowd:
            sock.sendall(head() + b"X-Slow: a")  # half a head each
        served(strict)
        answers = [read_until_closed(sock, timeout=10) for sock in crowd]
    assert all(error_of(answer, 408)["code"] == "request_timeout" for answer in answers)
    served(strict)
    assert len(upstream.requests) == 2  # the two normal chats


def test_a_slow_body_is_408_at_its_deadline(strict: ServerThread, upstream: FakeUpstream) -> None:
    with connect(strict.port) as sock:
        sock.sendall(head(extra=b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n") + b'{"model":')
        served(strict)
        answer = read_until_closed(sock, timeout=10)
    error = error_of(answer, 408)
    assert error["code"] == "request_timeout" and "body" in str(error["message"])
    assert len(upstream.requests) == 1  # only the normal client's


def test_a_body_answered_early_gets_no_second_answer_at_its_deadline(
    strict: ServerThread, upstream: FakeUpstream
) -> None:
    """A body over the limit is a 413 before it is read; when the rest never comes, the connection is
    closed at the body deadline without a 408 after the 413 (two answers to one request)."""
    with connect(strict.port) as sock:
        sock.sendall(head(extra=b"content-type: application/json\r\ncontent-length: 99999999\r\n\r\n") + b"x" * 1000)
        answer = read_until_closed(sock, timeout=10)
    assert [status for status, _ in responses(answer)] == [413], answer  # and nothing after it
    assert b'"code":"request_too_large"' in answer
    assert upstream.requests == []


def test_a_client_that_stops_reading_a_stream_is_closed_at_the_send_timeout(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    """Backpressure holds a stream (and the worker call behind it) while its client reads nothing; a client
    that never read again used to hold both for as long as it kept the connection open. After
    GATEWAY_SEND_TIMEOUT_S with nothing taken, the connection is closed and the worker call with it."""
    upstream.behavior.text = "x" * 20_000_000
    upstream.behavior.chunks = 2000  # 20 MB in 10 KB events, far beyond the socket buffers
    body = b'{"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": true}'
    with gateway_factory(base_config([upstream_url]), send_timeout_s=1.0) as (_, server):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.connect(("127.0.0.1", server.port))
        with sock:
            sock.sendall(head(extra=b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)) + body)
            deadline = time.monotonic() + 20
            while upstream.disconnects == 0 and time.monotonic() < deadline:
                time.sleep(0.1)  # and reads nothing
            assert upstream.disconnects == 1, stalled_stream_diagnosis(sock, upstream)
            assert upstream.completed_streams == 0
            read_until_closed(sock, timeout=10)  # what was buffered, then the end
        served(server)


def stalled_stream_diagnosis(sock: socket.socket, upstream: FakeUpstream) -> str:
    """What a failed send-timeout test saw, read only once it failed: whether the stream reached the worker
    and ended there, and how the client's answer began (an error instead of the stream, or the stream)."""
    sock.settimeout(2)
    try:
        start = sock.recv(300)
    except OSError as exc:
        start = repr(exc).encode()
    paths = [seen.path for seen in upstream.requests]
    return (
        f"worker requests {paths}, streams completed {upstream.completed_streams}; the client's answer began {start!r}"
    )


def test_connections_that_never_send_are_closed_without_a_reply(strict: ServerThread) -> None:
    with sockets(strict.port, 300) as idle:
        served(strict)
        started = time.monotonic()
        assert all(closed_by_server(sock, timeout=10) for sock in idle)
        assert time.monotonic() - started < 8
    served(strict)


def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(strict: ServerThread) -> None:
    with connect(strict.port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        assert closed_by_server(sock, timeout=10)
