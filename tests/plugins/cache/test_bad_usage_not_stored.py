"""An answer whose usage claims more completion tokens than its output can hold (a faulty or hostile
worker's 10^9 in "Hello") is not stored: every hit would replay the claim, and billing reads a replayed
stream's usage alone, so each hit was charged 10^9 tokens. Through the gateway, tenancy before the cache,
against real Redis."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from gateway.server.app import GatewayApp
from tests.plugins.tenancy.test_bad_worker_usage import PROMPT_ESTIMATE, ReadChunks
from tests.plugins.tenancy.test_billing import HEADERS, MESSAGES, config, settled
from tests.support.cache import entry_names, namespace, redis_client
from tests.support.fakes import ServerThread
from tests.support.gateways import GatewayFactory
from tests.support.scripted_worker import ScriptedWorker, chunk, completion
from tests.support.tenancy import prefix

__all__ = ["namespace", "prefix", "redis_client"]  # fixtures used by name below

ABSURD = {"prompt_tokens": 5, "completion_tokens": 10**9, "total_tokens": 10**9 + 5}
EVENTS = [
    chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}, model="m1", created=7),
    chunk({"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}, model="m1", created=7),
    chunk({"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}, model="m1", created=7),
    chunk(None, usage=ABSURD, model="m1", created=7),
    b"[DONE]",
]


@pytest.fixture(params=["pass-through", "parsed"])
def gateway(
    request: pytest.FixtureRequest, gateway_factory: GatewayFactory, prefix: str, namespace: str
) -> Iterator[tuple[ScriptedWorker, GatewayApp, ServerThread]]:
    """Tenancy, the cache and routing in front of a scripted worker; its streams relayed as bytes (the
    core records them for the cache) or parsed event by event (a plugin after the cache reads them)."""
    parsed = request.param == "parsed"
    worker = ScriptedWorker()
    worker.body = completion(usage=ABSURD, model="m1", created=7)
    worker.events = EVENTS
    with ServerThread(worker) as upstream:
        cfg = config(prefix, upstream.url, {"tokens_per_day": 1000}, between=("read_chunks",) if parsed else ())
        cache = {"name": "cache", "config": {"namespace": namespace, "timeout_ms": 200}}
        cfg["plugins"].insert(1, cache)
        with gateway_factory(cfg, plugins={"read_chunks": ReadChunks}, admin_token="adm") as (app, server):
            yield worker, app, server


def _ask(server: ServerThread, *, stream: bool) -> None:
    body: dict[str, Any] = {"model": "m1", "messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    body["stream"] = stream
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=30)
    assert reply.status_code == 200, reply.text


def _store_decided(app: GatewayApp, timeout_s: float = 15) -> None:
    """Wait until the cache stored the answer or decided not to (stores happen after the reply)."""
    registry = app.state.services.metrics.registry
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        decided = sum(
            sample.value
            for metric in registry.collect()
            if metric.name in ("gateway_cache_stores", "gateway_cache_not_stored")
            for sample in metric.samples
            if sample.name.endswith("_total")
        )
        if decided:
            return
        time.sleep(0.02)
    raise AssertionError("the cache neither stored the answer nor decided not to")


@pytest.mark.parametrize("first", ["stream", "json"])
def test_an_answer_whose_usage_its_output_cannot_hold_is_not_stored_nor_replayed(
    gateway: tuple[ScriptedWorker, GatewayApp, ServerThread],
    redis_client: redis.Redis,
    namespace: str,
    first: str,
) -> None:
    """The first answer (streamed, or whole) is charged by its text; it is not stored, so the same request
    streamed again goes to the worker and is charged by its events, not a stored 10^9."""
    worker, app, server = gateway
    _ask(server, stream=first == "stream")
    settled(server, lambda d: d["requests"] == 1 and d["tokens"] < PROMPT_ESTIMATE + 16)
    _store_decided(app)
    _ask(server, stream=True)
    day = settled(server, lambda d: d["requests"] == 2 and d["tokens"] < 2 * PROMPT_ESTIMATE + 16)
    assert (day["prompt_tokens"], day["completion_tokens"]) == (2 * PROMPT_ESTIMATE, 2 * 2)
    assert len(worker.requests) == 2 and entry_names(redis_client, namespace) == []
