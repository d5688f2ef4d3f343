"""``gateway_in_flight_requests`` counts a streamed answer for as long as it streams, on every route that
streams: the chat route, and the translated ones (Anthropic Messages, Responses), whose stream is the chat
stream read and translated. An operator's dashboards and the console read the gauge: a long agent stream
on ``/v1/messages`` is as much in flight as a chat stream. Once the client leaves, the gauge is back to 0.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.support.metrics import admin_metrics

ROUTES = {
    "chat": ("/v1/chat/completions", {"model": "m1", "messages": [{"role": "user", "content": "Hi"}]}),
    "messages": ("/v1/messages", {"model": "m1", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}),
    "responses": ("/v1/responses", {"model": "m1", "input": "Hi", "store": False}),
}


def in_flight(server: ServerThread) -> float:
    """The gauge for model m1 (0 when it has no series yet)."""
    for family in text_string_to_metric_families(admin_metrics(server)):
        for sample in family.samples:
            if sample.name == "gateway_in_flight_requests" and sample.labels.get("model") == "m1":
                return sample.value
    return 0.0


@pytest.fixture
def prefix() -> Iterator[str]:
    prefix = f"test:in-flight-streams:{uuid.uuid4().hex}"
    yield prefix
    with redis.Redis() as client:
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_stream_is_in_flight_until_it_ends(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str, route: str
) -> None:
    path, body = ROUTES[route]
    upstream.behavior.hang_after = 1  # one chunk, then nothing until the gateway hangs up
    config = base_config([upstream_url], responses={"redis_prefix": prefix})
    with gateway_factory(config) as (_, server):
        with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=10) as reply:
            assert reply.status_code == 200
            events = reply.iter_bytes()  # kept: a generator dropped here would close the connection
            assert next(events)  # the stream has begun: its first events came
            during: Any = in_flight(server)
        deadline = time.monotonic() + 10
        while (upstream.disconnects < 1 or in_flight(server)) and time.monotonic() < deadline:
            time.sleep(0.05)
        after = in_flight(server)
    assert during == 1, f"{path}: {during} in flight while its stream was open"
    assert upstream.disconnects == 1 and after == 0
