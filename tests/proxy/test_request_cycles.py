"""A finished request leaves nothing for the cycle collector: its objects are freed by reference counting
the moment it ends. With hundreds of streams in flight, requests left in reference cycles pile up
between full collections and make each one a pause of tens of milliseconds (bench/README.md)."""

from __future__ import annotations

import collections
import gc
import socket
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory, base_config

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def collector_paused() -> Iterator[None]:
    """Automatic collection off, so cycles made meanwhile are still there to be found."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def gateway_garbage() -> collections.Counter[str]:
    """Objects of the gateway's and plugins' own types that only the cycle collector would free."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = collections.Counter(
            type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith(("gateway.", "plugins."))
        )
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return found


def leave_mid_stream(port: int) -> None:
    body = orjson.dumps({**CHAT, "stream": True})
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        sock.recv(4096)  # the headers and a first event, then gone


def test_requests_of_every_kind_leave_no_reference_cycles(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, collector_paused: None
) -> None:
    upstream.behavior.pace_s = 0.02
    with gateway_factory(base_config([upstream_url])) as (_, server):
        url = server.url + "/v1/chat/completions"
        with httpx.Client(timeout=10) as client:
            for _ in range(3):
                assert client.post(url, json=CHAT).status_code == 200
                assert client.post(url, json={**CHAT, "stream": True}).text.endswith("data: [DONE]\n\n")
                assert client.post(url, json={**CHAT, "model": "nope"}).status_code == 404
                assert client.post(url, json={**CHAT, "messages": "x"}).status_code == 400
            upstream.behavior.cut_after = 1
            assert '"error"' in client.post(url, json={**CHAT, "stream": True}).text
            upstream.behavior.cut_after = None
            upstream.behavior.chunks = 50
            leave_mid_stream(server.port)
            deadline = time.monotonic() + 5
            while upstream.disconnects == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert upstream.disconnects == 1
        time.sleep(0.2)  # the cancelled request has finished unwinding
        assert gateway_garbage() == {}
