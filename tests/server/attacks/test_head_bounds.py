"""Heads beyond the front door's bounds: one huge header, many headers, a long request line, and a
100 MB header streamed at the gateway while another client measures /health."""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.attacks.raw import CHAT, connect, error_of, head, read_until_closed, served
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config


def send_and_read(port: int, data: bytes) -> bytes:
    with connect(port) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)  # may be refused mid-send: the answer was written before the close
        return read_until_closed(sock)


def test_a_head_beyond_the_bound_is_431_and_reaches_nothing(gateway: ServerThread, upstream: FakeUpstream) -> None:
    answer = send_and_read(gateway.port, head(extra=b"X-Big: " + b"a" * 64 * 1024 + b"\r\n\r\n"))
    error = error_of(answer, 431)
    assert error["code"] == "request_header_fields_too_large" and error["type"] == "invalid_request_error"
    assert upstream.requests == []
    served(gateway)


def test_a_head_just_within_the_bound_is_served(gateway: ServerThread, upstream: FakeUpstream) -> None:
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        reply = client.post("/v1/chat/completions", json=CHAT, headers={"x-filler": "f" * 30_000})
    assert reply.status_code == 200


def test_more_header_fields_than_the_bound_is_431(gateway: ServerThread, upstream: FakeUpstream) -> None:
    # host, content-length, connection and 97 more = 100 fields: served; one more: refused.
    # 100,000 tiny fields: refused as well.
    body = b'{"model": "m1", "messages": [{"role": "user", "content": "hi"}]}'
    framing = b"content-length: %d\r\nconnection: close\r\n" % len(body)

    def fields(count: int) -> bytes:
        return b"".join(b"x-h%d: v\r\n" % i for i in range(count)) + framing + b"\r\n" + body

    ok = send_and_read(gateway.port, head(extra=fields(97)))
    assert ok.startswith(b"HTTP/1.1 200"), ok[:200]
    over = send_and_read(gateway.port, head(extra=fields(98)))
    assert error_of(over, 431)["code"] == "request_header_fields_too_large"
    flood = send_and_read(gateway.port, head(extra=b"a: b\r\n" * 100_000 + b"\r\n"))
    assert error_of(flood, 431)["code"] == "request_header_fields_too_large"
    assert len(upstream.requests) == 1
    served(gateway)


CHUNKED_CHAT = b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n" % (
    len(json.dumps(CHAT)),
    json.dumps(CHAT).encode(),
)


@pytest.mark.parametrize(
    "trailers",
    [
        b"".join(b"x-t%d: v\r\n" % i for i in range(150)) + b"\r\n",  # more fields than the bound
        b"x-big: " + b"a" * 512 * 1024,  # one endless trailer (a field that ends within one read is bounded by it)
    ],
    ids=["many-fields", "one-huge-field"],
)
@pytest.mark.parametrize("late", [False, True], ids=["in-one-read", "after-the-body"])
def test_the_trailers_of_a_chunked_body_are_bounded_like_a_head(
    gateway: ServerThread, upstream: FakeUpstream, trailers: bytes, late: bool
) -> None:
    """Trailer fields after a chunked body's last chunk used to be read without any bound (800,000 of
    them went into the request's headers in a second, or one endless field into memory)."""
    with connect(gateway.port) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(head() + CHUNKED_CHAT)
            if late:
                time.sleep(0.2)
            for start in range(0, len(trailers), 4096):  # in pieces, as a client streams them
                sock.sendall(trailers[start : start + 4096])
        answer = read_until_closed(sock)
    error = error_of(answer, 431)
    assert error["code"] == "request_header_fields_too_large"
    assert upstream.requests == []
    served(gateway)


def test_a_chunked_body_with_a_few_trailers_is_served(gateway: ServerThread, upstream: FakeUpstream) -> None:
    with connect(gateway.port) as sock:
        sock.sendall(
            head() + CHUNKED_CHAT + b"x-checksum: 1\r\nx-other: 2\r\n\r\n" + b"GET /health HTTP/1.1\r\nHost: g\r\n\r\n"
        )
        answer = read_until_closed(sock, timeout=3)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert answer.count(b"HTTP/1.1 200 ") == 2
    assert len(upstream.requests) == 1
    assert "x-checksum" not in upstream.requests[0].headers


def test_a_request_line_beyond_8_kib_is_414(gateway: ServerThread, upstream: FakeUpstream) -> None:
    answer = send_and_read(gateway.port, head(path="/v1/models?" + "q" * 9000, method="GET") + b"\r\n")
    assert error_of(answer, 414)["code"] == "uri_too_long"
    # one that never ends (no CRLF at all) is refused as soon as it passes the bound
    endless = send_and_read(gateway.port, b"GET /" + b"a" * 20_000)
    assert error_of(endless, 414)["code"] == "uri_too_long"
    # a long line that did end, with the head still open: refused at once, not at the head's deadline
    started = time.monotonic()
    open_head = send_and_read(gateway.port, b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: gateway\r\n")
    assert error_of(open_head, 414)["code"] == "uri_too_long"
    assert time.monotonic() - started < 5
    served(gateway)


ATTACKER = r"""
import json, socket, sys
port, total = int(sys.argv[1]), int(sys.argv[2])
chunk = b"a" * 65536
sent, connections, answers = 0, 0, []
while sent < total:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    connections += 1
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: gateway\r\nX-Big: ")
        while sent < total:
            sock.sendall(chunk)
            sent += len(chunk)
    except OSError:
        pass
    try:
        sock.settimeout(2)
        answers.append(sock.recv(200).split(b"\r\n", 1)[0].decode())
    except OSError as exc:
        answers.append(type(exc).__name__)
    sock.close()
print(json.dumps({"sent": sent, "connections": connections, "answers": answers}))
"""


def health_latencies(
    client: httpx.Client, count: int | None = None, until: subprocess.Popen[str] | None = None
) -> list[float]:
    latencies = []
    while (count is not None and len(latencies) < count) or (until is not None and until.poll() is None):
        started = time.perf_counter()
        assert client.get("/health").status_code == 200
        latencies.append(time.perf_counter() - started)
    return latencies


@pytest.mark.parametrize("max_header_bytes", [None, 24 * 1024 * 1024], ids=["default-bound", "bound-raised-to-24MiB"])
def test_a_100_mb_header_stream_does_not_slow_other_clients(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, max_header_bytes: int | None
) -> None:
    """The attacker (its own process) streams 100 MB of one header, reconnecting whenever the gateway
    cuts it off. With the default bound each connection is answered 431 after 32 KiB and what follows
    is dropped; with the bound raised to 24 MiB the gateway collects up to 24 MiB of each head, which
    must cost linear work (httptools alone re-joins the header on every read: quadratic). Either way
    /health on another connection stays within a few ms of its idle latency."""
    settings = {} if max_header_bytes is None else {"max_header_bytes": max_header_bytes}
    with gateway_factory(base_config([upstream_url]), **settings) as (_, server):
        with httpx.Client(base_url=server.url, timeout=10) as client:
            idle = health_latencies(client, count=200)
            attacker = subprocess.Popen(
                [sys.executable, "-c", ATTACKER, str(server.port), str(100 * 1024 * 1024)],
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                during = health_latencies(client, until=attacker)
                out, _ = attacker.communicate(timeout=120)
            finally:
                attacker.kill()
        report = json.loads(out)
        print(
            f"\n100 MB header ({'default bound' if max_header_bytes is None else 'bound 24 MiB'}):"
            f" {report['connections']} connections, /health idle p50 {statistics.median(idle) * 1000:.2f} ms"
            f" max {max(idle) * 1000:.2f} ms; during the attack p50 {statistics.median(during) * 1000:.2f} ms"
            f" max {max(during) * 1000:.2f} ms over {len(during)} requests"
        )
        assert report["sent"] >= 100 * 1024 * 1024
        assert len(during) >= 5
        assert max(during) < 1.0  # loose: a quadratic parser made this 7.6 s for 200 MB
        assert all(answer.startswith("HTTP/1.1 431") or answer.endswith("Error") for answer in report["answers"])
        assert any(answer.startswith("HTTP/1.1 431") for answer in report["answers"]), report["answers"]
        served(server)
