"""Host (RFC 9112, section 3.2): a request with two Host fields, a Host that is not a host with an
optional port, or an HTTP/1.1 request with none is a 400 in OpenAI's shape, the connection is closed,
and no worker sees it. Two readers of such a head could route it to different hosts."""

from __future__ import annotations

import pytest

from tests.server.attacks.raw import connect, error_of, read_until_closed, responses, served
from tests.support.fakes import FakeUpstream, ServerThread

BODY = b'{"model": "m1", "messages": [{"role": "user", "content": "hi"}]}'
SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: gateway\r\n\r\n"


def chat(version: bytes, fields: bytes) -> bytes:
    return b"POST /v1/chat/completions HTTP/%b\r\n%bcontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (
        version,
        fields,
        len(BODY),
        BODY,
    )


REFUSED = {
    "two-hosts": chat(b"1.1", b"Host: gateway\r\nHost: evil.example\r\n"),
    "two-equal-hosts": chat(b"1.1", b"Host: gateway\r\nHost: gateway\r\n"),
    "two-hosts-other-case": chat(b"1.1", b"host: gateway\r\nX-A: 1\r\nHOST: evil.example\r\n"),
    "two-hosts-http-1.0": chat(b"1.0", b"Host: gateway\r\nHost: evil.example\r\n"),
    "no-host-http-1.1": chat(b"1.1", b""),
    "a-comma-list": chat(b"1.1", b"Host: gateway, evil.example\r\n"),
    "a-comma": chat(b"1.1", b"Host: gateway,evil.example\r\n"),
    "a-space": chat(b"1.1", b"Host: gate way\r\n"),
    "userinfo": chat(b"1.1", b"Host: user@gateway\r\n"),
    "a-path": chat(b"1.1", b"Host: gateway/v1\r\n"),
    "a-port-not-a-number": chat(b"1.1", b"Host: gateway:80a\r\n"),
    "two-ports": chat(b"1.1", b"Host: gateway:80:81\r\n"),
    "an-open-ip-literal": chat(b"1.1", b"Host: [::1\r\n"),
}


@pytest.mark.parametrize("raw", list(REFUSED.values()), ids=list(REFUSED))
def test_a_bad_host_is_400_and_nothing_after_it_is_served(
    gateway: ServerThread, upstream: FakeUpstream, raw: bytes
) -> None:
    with connect(gateway.port) as sock:
        sock.sendall(raw + SMUGGLED)
        answer = read_until_closed(sock)
    error = error_of(answer, 400)  # also checks content-type and connection: close
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_http_request"
    assert "Host" in str(error["message"])
    assert len(responses(answer)) == 1, answer  # what followed on the connection was not served
    assert upstream.requests == []
    served(gateway)


def test_a_bad_host_in_the_same_read_as_the_request_before_it_is_refused_after_its_answer(
    gateway: ServerThread, upstream: FakeUpstream
) -> None:
    # The second head is parsed from the read of the first (pipelined): checked after parsing.
    with connect(gateway.port) as sock:
        sock.sendall(chat(b"1.1", b"Host: gateway\r\n") + chat(b"1.1", b"Host: a\r\nHost: b\r\n") + SMUGGLED)
        answer = read_until_closed(sock)
    (first, _), (second, body) = responses(answer)
    assert (first, second) == (200, 400), answer
    assert b"more than one Host" in body
    assert len(upstream.requests) == 1


def test_a_bad_host_in_a_head_that_spans_reads_is_refused(gateway: ServerThread, upstream: FakeUpstream) -> None:
    raw = chat(b"1.1", b"Host: gateway\r\nHost: evil.example\r\n")
    with connect(gateway.port) as sock:
        sock.sendall(raw[:30])
        sock.sendall(raw[30:])
        answer = read_until_closed(sock)
    assert error_of(answer, 400)["code"] == "invalid_http_request"
    assert upstream.requests == []


SERVED = {
    "name": chat(b"1.1", b"Host: gateway\r\n"),
    "name-and-port": chat(b"1.1", b"Host: gateway.example:8000\r\n"),
    "lower-case-field": chat(b"1.1", b"host: 127.0.0.1:8000\r\n"),
    "ipv6": chat(b"1.1", b"Host: [::1]:8000\r\n"),
    "trailing-space": chat(b"1.1", b"Host: gateway \r\n"),
    "empty": chat(b"1.1", b"Host:\r\n"),  # RFC 9110 7.2: a target without an authority
    "not-first": chat(b"1.1", b"Accept: */*\r\nHost: gateway\r\n"),
    "no-host-http-1.0": chat(b"1.0", b""),
}


@pytest.mark.parametrize("raw", list(SERVED.values()), ids=list(SERVED))
def test_a_valid_host_or_none_on_http_1_0_is_served(gateway: ServerThread, upstream: FakeUpstream, raw: bytes) -> None:
    with connect(gateway.port) as sock:
        sock.sendall(raw.replace(b"content-type:", b"Connection: close\r\ncontent-type:"))
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert len(upstream.requests) == 1
