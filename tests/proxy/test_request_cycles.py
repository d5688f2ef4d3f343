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


def test_refusals_by_a_plugin_leave_no_reference_cycles_in_any_api(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, collector_paused: None
) -> None:
    """A plugin's refusal (guided_json: a forced call's arguments fail their schema), as a whole answer or
    ending a stream, through chat completions and the Responses and Messages translations."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    upstream.behavior.tool_calls = [{"id": "call_1", "name": "f", "arguments": '{"city": 5}'}]
    plugins = [{"name": "guided_json", "config": {"probe": False}}, {"name": "routing"}]
    function = {"name": "f", "parameters": schema}
    asks = {
        "/v1/chat/completions": {**CHAT, "tool_choice": "required",
                                 "tools": [{"type": "function", "function": function}]},
        "/v1/responses": {"model": "m1", "input": "hi", "store": False, "tool_choice": "required",
                          "tools": [{"type": "function", **function}]},
        "/v1/messages": {"model": "m1", "max_tokens": 16, "messages": CHAT["messages"], "tool_choice": {"type": "any"},
                         "tools": [{"name": "f", "input_schema": schema}]},
    }  # fmt: skip
    with (
        gateway_factory(base_config([upstream_url], plugins=plugins)) as (_, server),
        httpx.Client(timeout=10) as client,
    ):
        for path, body in asks.items():
            for stream in (False, True):
                reply = client.post(server.url + path, json={**body, "stream": stream})
                assert reply.status_code == (200 if stream else 422) and "answer does not match" in reply.text
        time.sleep(0.2)
        assert gateway_garbage() == {}
