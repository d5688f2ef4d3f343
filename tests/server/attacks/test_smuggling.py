"""Request smuggling forms: every framing two HTTP readers could disagree on is a 400 in OpenAI's shape,
the connection is closed, and nothing that follows on it is served (the smuggled request included)."""

from __future__ import annotations

import time

import pytest

from tests.server.attacks.raw import connect, error_of, read_until_closed, responses, served
from tests.support.fakes import FakeUpstream, ServerThread

POST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\ncontent-type: application/json\r\n"
SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: gateway\r\n\r\n"

FORMS = {
    # CL.TE / TE.CL: both framings on one request
    "content-length-and-chunked": POST + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "chunked-and-content-length": POST + b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "two-different-content-lengths": POST + b"Content-Length: 2\r\nContent-Length: 45\r\n\r\n{}" + SMUGGLED,
    "two-equal-content-lengths": POST + b"Content-Length: 2\r\nContent-Length: 2\r\n\r\n{}" + SMUGGLED,
    "content-length-list": POST + b"Content-Length: 2, 2\r\n\r\n{}" + SMUGGLED,
    "content-length-plus-sign": POST + b"Content-Length: +2\r\n\r\n{}" + SMUGGLED,
    "content-length-negative": POST + b"Content-Length: -1\r\n\r\n{}" + SMUGGLED,
    # Transfer-Encoding obfuscations
    "te-xchunked": POST + b"Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "te-chunked-then-identity": POST + b"Transfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "te-twice": POST + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "te-space-before-colon": POST + b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "te-obs-fold": POST + b"Transfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "te-vertical-tab": POST + b"Transfer-Encoding:\x0bchunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "chunk-size-overflow": POST + b"Transfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFFF1\r\nabc\r\n0\r\n\r\n",
    "chunk-size-bare-lf": POST + b"Transfer-Encoding: chunked\r\n\r\n2\n{}\r\n0\r\n\r\n" + SMUGGLED,
    # line endings and bytes two readers split differently
    "bare-lf-everywhere": b"GET /health HTTP/1.1\nHost: gateway\n\n" + SMUGGLED,
    "bare-lf-in-a-header": b"GET /health HTTP/1.1\r\nHost: gateway\nX-Smuggle: 1\r\n\r\n" + SMUGGLED,
    "bare-cr-in-a-header": b"GET /health HTTP/1.1\r\nHost: gateway\rX-Smuggle: 1\r\n\r\n" + SMUGGLED,
    "nul-in-a-header": b"GET /health HTTP/1.1\r\nHost: gateway\r\nX-A: a\x00b\r\n\r\n" + SMUGGLED,
    "space-in-the-target": b"GET /health HTTP/1.1 x\r\nHost: gateway\r\n\r\n" + SMUGGLED,
    # versions
    "http-0.9": b"GET /health\r\n\r\n" + SMUGGLED,
    "http-2.0-text": b"GET /health HTTP/2.0\r\nHost: gateway\r\n\r\n" + SMUGGLED,
}


@pytest.mark.parametrize("raw", list(FORMS.values()), ids=list(FORMS))
def test_a_smuggling_form_is_400_and_nothing_after_it_is_served(
    gateway: ServerThread, upstream: FakeUpstream, raw: bytes
) -> None:
    with connect(gateway.port) as sock:
        sock.sendall(raw)
        answer = read_until_closed(sock)
    error = error_of(answer, 400)  # error_of also checks connection: close
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_http_request"
    assert len(responses(answer)) == 1, answer  # the smuggled request got no answer
    assert upstream.requests == []
    served(gateway)


@pytest.mark.parametrize(
    "raw",
    [
        POST + b"Transfer-Encoding: chunked\r\n\r\n",
        POST + b"Transfer-Encoding: CHUNKED\r\n\r\n",
        POST + b"Transfer-Encoding:\tchunked\r\n\r\n",
    ],
    ids=["chunked", "upper-case", "tab-before-value"],
)
def test_plain_chunked_bodies_are_still_served(gateway: ServerThread, upstream: FakeUpstream, raw: bytes) -> None:
    body = b'{"model": "m1", "messages": [{"role": "user", "content": "hi"}]}'
    chunked = b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
    with connect(gateway.port) as sock:
        sock.sendall(raw.replace(b"Host: gateway", b"Host: gateway\r\nConnection: close") + chunked)
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert len(upstream.requests) == 1


@pytest.mark.parametrize("upgrade", [b"foo", b"h2c"])
@pytest.mark.parametrize("late", [False, True], ids=["body-in-the-same-read", "body-in-a-later-read"])
def test_the_body_of_an_upgrade_request_is_never_run_as_a_request(
    gateway: ServerThread, upstream: FakeUpstream, upgrade: bytes, late: bool
) -> None:
    """llhttp parses a request asking for an Upgrade (other than a WebSocket) without its body: what its
    Content-Length announces was run as a request of its own when it came in a later read. Such a request
    is now answered with connection: close and nothing after it on the connection is served."""
    head = POST + b"Connection: Upgrade\r\nUpgrade: %b\r\nContent-Length: %d\r\n\r\n" % (upgrade, len(SMUGGLED))
    with connect(gateway.port) as sock:
        sock.sendall(head if late else head + SMUGGLED)
        if late:
            time.sleep(0.2)
            sock.sendall(SMUGGLED)
        answer = read_until_closed(sock)
    answers = responses(answer)
    assert len(answers) == 1, answer  # the smuggled request got no answer
    assert b"connection: close\r\n" in answer.lower()
    assert upstream.requests == []
    served(gateway)
