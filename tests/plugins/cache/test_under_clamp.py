"""The cache under tenancy's ``without_max_tokens: clamp``, through the gateway against real Redis.

Tenancy writes a ``max_tokens`` that follows what the tenant has left into a request that has none; the
cache keys the request as the client sent it (``ctx.clamped_max_tokens``), stores only answers the clamp
did not cut, and serves a hit only when it is no longer than this request's clamp.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import orjson
import pytest
import redis

from gateway.server.app import GatewayApp
from plugins.tenancy.keys import hash_key
from tests.support.cache import entry_names, namespace, redis_client, wait_stored
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.support.tenancy import PEPPER, prefix

__all__ = ["namespace", "prefix", "redis_client"]  # fixtures used by name below

KEYS = {"k1": ("t1", "sk-gw-clamp-cache-one"), "k2": ("t2", "sk-gw-clamp-cache-two")}
CONTEXT = 64  # the model's max_model_len
# "abcd" is 5 prompt tokens by tenancy's estimate and by the fake worker's usage.
BODY = {"model": "m1", "messages": [{"role": "user", "content": "abcd"}], "temperature": 0}
ADMIN = "adm"


def config(upstream_url: str, prefix: str, namespace: str, tokens_per_day: int) -> dict[str, Any]:
    """Tenancy clamping (two keys of two tenants, each with ``tokens_per_day``), the cache, routing."""
    keys = [
        {"id": key_id, "tenant": tenant, "hash": hash_key(key, PEPPER.encode()), "limits": {"tokens_per_day": limit}}
        for key_id, (tenant, key), limit in ((k, v, tokens_per_day) for k, v in KEYS.items())
    ]
    plugins = [
        {"name": "tenancy", "config": {"redis_prefix": prefix, "keys": keys, "without_max_tokens": "clamp"}},
        {"name": "cache", "config": {"namespace": namespace, "timeout_ms": 200}},
        {"name": "routing"},
    ]
    cfg = base_config([upstream_url], plugins=plugins)
    cfg["models"][0]["max_model_len"] = CONTEXT
    return cfg


def ask(server: ServerThread, *, stream: bool, key_id: str = "k1") -> httpx.Response:
    body = {**BODY, "stream": True} if stream else BODY
    headers = {"authorization": f"Bearer {KEYS[key_id][1]}"}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def text_of(reply: httpx.Response, stream: bool) -> str:
    if not stream:
        return str(reply.json()["choices"][0]["message"]["content"])
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: {")]
    return "".join(
        choice["delta"].get("content") or "" for event in events for choice in orjson.loads(event)["choices"]
    )


def finish_of(reply: httpx.Response, stream: bool) -> str | None:
    if not stream:
        return reply.json()["choices"][0]["finish_reason"]  # type: ignore[no-any-return]
    events = [orjson.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
    reasons = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
    return reasons[-1] if reasons else None


def clamp_of(reply: httpx.Response) -> int:
    return int(reply.headers["x-gateway-max-tokens"])


def day_tokens(server: ServerThread, want: int, timeout_s: float = 15) -> int:
    """The key k1's tokens used today, once they reach ``want`` (a streamed hit is charged when the
    request is over, a moment after its last byte)."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = httpx.post(
            server.url + "/admin/plugins/tenancy/usage",
            json={"key_id": "k1"},
            headers={"authorization": f"Bearer {ADMIN}"},
        )
        assert reply.status_code == 200, reply.text
        tokens = int(reply.json()["result"]["day"]["tokens"])
        if tokens >= want or time.monotonic() > deadline:
            return tokens
        time.sleep(0.05)


def not_stored(app: GatewayApp, reason: str) -> float | None:
    return app.state.services.metrics.registry.get_sample_value(  # type: ignore[no-any-return]
        "gateway_cache_not_stored_total", {"model": "m1", "reason": reason}
    )


@pytest.mark.parametrize("stream", [False, True])
def test_a_clamped_request_hits_the_answer_to_the_same_request_under_another_clamp(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    namespace: str,
    redis_client: redis.Redis,
    stream: bool,
) -> None:
    """40 tokens a day: the first request is clamped to 35, the second (8 tokens spent) to 27; both are
    the request the client sent, without max_tokens, and the second is answered from the cache."""
    with gateway_factory(config(upstream_url, prefix, namespace, 40), admin_token=ADMIN) as (_, server):
        first = ask(server, stream=stream)
        assert (first.status_code, first.headers["x-cache"]) == (200, "miss")
        wait_stored(redis_client, namespace)
        day_tokens(server, 8)
        second = ask(server, stream=stream)
    assert second.status_code == 200 and second.headers["x-cache"] == "hit"
    assert (clamp_of(first), clamp_of(second)) == (35, 27)  # two clamps, one entry
    assert [seen.body["max_tokens"] for seen in upstream.requests] == [35]
    assert text_of(second, stream) == text_of(first, stream) == upstream.behavior.text


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_cut_at_the_clamp_is_not_stored(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    namespace: str,
    redis_client: redis.Redis,
    stream: bool,
) -> None:
    """An answer that ended at the clamped max_tokens (``finish_reason: length``) is not what the same
    request gets with more budget: it is not stored; one that stopped on its own is."""
    # More than the clamp (59): the worker stops at max_tokens. The fake worker cuts only its streams
    # there: its JSON answer is given the length a real worker's would have.
    upstream.behavior.chunks = 70 if stream else 59
    upstream.behavior.text = "t" * 70
    upstream.behavior.finish_reason = "stop" if stream else "length"
    with gateway_factory(config(upstream_url, prefix, namespace, 100), admin_token=ADMIN) as (app, server):
        cut = ask(server, stream=stream)
        assert cut.status_code == 200 and finish_of(cut, stream) == "length"
        assert not_stored(app, "clamped") == 1
        time.sleep(0.2)
        assert entry_names(redis_client, namespace) == []
        upstream.behavior.chunks, upstream.behavior.text, upstream.behavior.finish_reason = 3, "done.", "stop"
        day_tokens(server, 64)
        whole = ask(server, stream=stream)
        assert whole.headers["x-cache"] == "miss" and finish_of(whole, stream) == "stop"
        wait_stored(redis_client, namespace)
        again = ask(server, stream=stream)
    assert again.headers["x-cache"] == "hit" and text_of(again, stream) == "done."
    assert len(upstream.requests) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_a_cached_answer_longer_than_the_clamp_is_not_served(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    namespace: str,
    redis_client: redis.Redis,
    stream: bool,
) -> None:
    """60 tokens a day, answers of 20 tokens: stored under a clamp of 55, served under one of 30, not
    under one of 5 (the client would get more than its clamp allowed, and be charged past its budget):
    that one goes to the worker with max_tokens 5."""
    upstream.behavior.chunks = 20
    upstream.behavior.text = "t" * 20
    with gateway_factory(config(upstream_url, prefix, namespace, 60), admin_token=ADMIN) as (_, server):
        first = ask(server, stream=stream)
        wait_stored(redis_client, namespace)
        day_tokens(server, 25)
        fits = ask(server, stream=stream)
        assert (clamp_of(first), clamp_of(fits), fits.headers["x-cache"]) == (55, 30, "hit")
        day_tokens(server, 50)
        if not stream:  # the fake worker cuts only its streams at max_tokens: as a real one would
            upstream.behavior.chunks, upstream.behavior.finish_reason = 5, "length"
        longer = ask(server, stream=stream)
        spent = day_tokens(server, 60)
    assert longer.status_code == 200 and clamp_of(longer) == 5
    assert longer.headers["x-cache"] == "miss" and finish_of(longer, stream) == "length"
    assert [seen.body["max_tokens"] for seen in upstream.requests] == [55, 5]
    assert spent == 60  # the budget is never passed


def test_tenants_stay_apart_under_clamp(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    """Keyed without the clamped max_tokens (35, then 27), a request is still keyed by its tenant: each
    tenant hits its own answer, never the other's."""
    with gateway_factory(config(upstream_url, prefix, namespace, 40)) as (_, server):
        upstream.behavior.text = "t1's own answer"
        first_t1 = ask(server, stream=False, key_id="k1")
        wait_stored(redis_client, namespace)
        upstream.behavior.text = "t2's own answer"
        first_t2 = ask(server, stream=False, key_id="k2")
        wait_stored(redis_client, namespace, 2)
        again_t1, again_t2 = ask(server, stream=False, key_id="k1"), ask(server, stream=False, key_id="k2")
    assert [r.headers["x-cache"] for r in (first_t1, first_t2, again_t1, again_t2)] == ["miss", "miss", "hit", "hit"]
    assert text_of(again_t1, False) == "t1's own answer" and text_of(again_t2, False) == "t2's own answer"
    assert len(upstream.requests) == 2
