"""Pipelined requests are answered in order, one at a time; a client that pipelines thousands of
requests without reading the answers holds only its own connection."""

from __future__ import annotations

import time

import orjson

from tests.server.attacks.raw import CHAT, connect, error_of, read_until_closed, responses, served
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.faults import wait_for
from tests.support.gateways import GatewayFactory, base_config

BODY = orjson.dumps(CHAT)
POST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n%b" % (len(BODY), BODY)
)
HEALTH = b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n"
STREAM = orjson.dumps({**CHAT, "stream": True})
STREAM_POST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n%b" % (len(STREAM), STREAM)
)


def read_answers(sock: object, count: int, timeout: float = 30) -> list[tuple[int, bytes]]:
    import socket

    assert isinstance(sock, socket.socket)
    sock.settimeout(timeout)
    data = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            found = responses(data)
        except (ValueError, KeyError, IndexError):  # a response cut in the middle: read on
            found = []
        if len(found) >= count:
            return found
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        data += chunk
    return responses(data)


def test_pipelined_requests_are_answered_in_order(gateway: ServerThread, upstream: FakeUpstream) -> None:
    with connect(gateway.port) as sock:
        sock.sendall(HEALTH + POST + b"GET /v1/models HTTP/1.1\r\nHost: gateway\r\n\r\n")
        answers = read_answers(sock, 3)
    assert [status for status, _ in answers] == [200, 200, 200]
    assert orjson.loads(answers[0][1]) == {"status": "ok"}
    assert orjson.loads(answers[1][1])["object"] == "chat.completion"
    assert orjson.loads(answers[2][1])["object"] == "list"
    assert len(upstream.requests) == 1


def test_a_pipelining_flood_holds_only_its_own_connection(gateway: ServerThread, upstream: FakeUpstream) -> None:
    count = 3000
    with connect(gateway.port) as sock:
        sock.sendall((HEALTH + POST) * (count // 2))  # and reads nothing for now
        served(gateway)
        answers = read_answers(sock, count, timeout=120)
    assert len(answers) == count
    assert all(status == 200 for status, _ in answers)
    assert len(upstream.requests) == count // 2 + 1


def test_a_pipelined_head_beyond_the_bounds_is_refused_after_the_request_before_it(
    gateway: ServerThread, upstream: FakeUpstream
) -> None:
    """A head that arrives in the same read as the request before it is checked as it is parsed."""
    too_many = (
        b"GET /health HTTP/1.1\r\nHost: gateway\r\n" + b"".join(b"x-h%d: v\r\n" % i for i in range(150)) + b"\r\n"
    )
    with connect(gateway.port) as sock:
        sock.sendall(HEALTH + too_many + HEALTH)
        data = read_until_closed(sock)
    answers = responses(data)
    assert [status for status, _ in answers] == [200, 431], data[:600]
    assert orjson.loads(answers[1][1])["error"]["code"] == "request_header_fields_too_large"
    served(gateway)


def test_a_client_that_leaves_ends_the_stream_ahead_of_its_pipelined_request(
    gateway: ServerThread, upstream: FakeUpstream
) -> None:
    """The stream being answered sees the disconnect too, not only the request queued behind it: its worker
    call is closed (vLLM aborts the generation) instead of running to the end for nobody."""
    upstream.behavior.chunks = 50
    upstream.behavior.pace_s = 0.1  # 5 s of stream
    with connect(gateway.port) as sock:
        sock.sendall(STREAM_POST + HEALTH)
        assert sock.recv(100).startswith(b"HTTP/1.1 200")
    deadline = time.monotonic() + 3
    while upstream.disconnects == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert upstream.disconnects == 1
    assert upstream.completed_streams == 0
    served(gateway)


def _after_the_stream(data: bytes) -> bytes:
    """What follows a complete streamed answer (its [DONE] and last chunk) in ``data``."""
    assert data.startswith(b"HTTP/1.1 200 OK\r\n"), data[:300]
    done = data.index(b"data: [DONE]\n\n\r\n0\r\n\r\n") + len(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert b"HTTP/1.1 4" not in data[:done], data[:done]
    return data[done:]


def test_a_pipelined_request_refused_in_its_body_is_answered_after_the_stream_before_it(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    """A request queued behind a stream whose body is not complete in time (or is malformed) is refused
    after the stream, never in the middle of it (the 408 used to cut into the stream's chunks)."""
    upstream.behavior.chunks = 6
    upstream.behavior.pace_s = 0.4  # 2.4 s of stream, beyond the 1 s body deadline
    queued = {
        "request_timeout": b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\ncontent-length: 10\r\n\r\n012",
        "invalid_http_request": b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
        b"transfer-encoding: chunked\r\n\r\nzz\r\n",
    }
    with gateway_factory(base_config([upstream_url]), body_timeout_s=1) as (_, server):
        for code, request in queued.items():
            with connect(server.port) as sock:
                sock.sendall(STREAM_POST + request)
                data = read_until_closed(sock)
            error = error_of(_after_the_stream(data), 408 if code == "request_timeout" else 400)
            assert error["code"] == code
        served(server)
    wait_for(lambda: upstream.completed_streams == 2, 5, "the worker to finish both streams")


def test_a_slow_head_after_queued_requests_is_refused_after_their_answers(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    """A request queued whole behind a stream is still answered when the head after it times out (it used
    to be dropped with no answer at all, and the 408 never came)."""
    upstream.behavior.chunks = 6
    upstream.behavior.pace_s = 0.4
    with gateway_factory(base_config([upstream_url]), header_timeout_s=1) as (_, server), connect(server.port) as sock:
        sock.sendall(STREAM_POST + HEALTH)
        time.sleep(0.2)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: gat")
        data = read_until_closed(sock)
    rest = _after_the_stream(data)
    answers = responses(rest)
    assert [status for status, _ in answers] == [200, 408], rest[:600]
    assert orjson.loads(answers[0][1]) == {"status": "ok"}
    assert orjson.loads(answers[1][1])["error"]["code"] == "request_timeout"


def test_a_websocket_upgrade_behind_a_stream_does_not_take_the_connection_over(
    gateway: ServerThread, upstream: FakeUpstream
) -> None:
    """A WebSocket handshake pipelined behind a stream used to take the connection at once: its refusal was
    the first answer the client read (for its POST), and the stream was lost. The stream is answered whole
    and the connection is closed after it."""
    upstream.behavior.chunks = 5
    upstream.behavior.pace_s = 0.2
    websocket = (
        b"GET /v1/responses HTTP/1.1\r\nHost: gateway\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    with connect(gateway.port) as sock:
        sock.sendall(STREAM_POST + websocket)
        data = read_until_closed(sock)
    assert _after_the_stream(data) == b""
    assert b"connection: close\r\n" in data.split(b"\r\n\r\n", 1)[0].lower()
    # the fake worker counts a stream once its last send returns, which may be after the client has it
    wait_for(lambda: upstream.completed_streams == 1, 5, "the worker to finish the stream")
    served(gateway)
