"""Tenancy billing against a real vLLM CPU worker: a stream that carries no usage is charged the tokens
it sent, which match vLLM's own count for the same request; a stream the client cuts is charged for
what went out (and vLLM stops generating); without max_tokens the context is reserved, or max_tokens
is clamped to what the key has left."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import redis

from plugins.tenancy.budgets import budgets_for
from plugins.tenancy.config import Limits
from plugins.tenancy.keys import hash_key
from tests.support.fakes import ServerThread
from tests.support.gateways import GatewayFactory
from tests.support.tenancy import PEPPER, prefix

__all__ = ["prefix"]  # the fixture, used by name

pytestmark = pytest.mark.engine

KEY = "sk-gw-e2e-tenancy"
ASK = [{"role": "user", "content": "Count from one to forty in words, separated by commas."}]


def gateway_config(prefix: str, worker_url: str, limits: dict[str, int], **section: Any) -> dict[str, Any]:
    keys = [{"id": "k1", "tenant": "t1", "hash": hash_key(KEY, PEPPER.encode()), "limits": limits}]
    return {
        "models": [{"name": "smollm2", "workers": [worker_url], "max_model_len": 2048}],
        "plugins": [
            {"name": "tenancy", "config": {"redis_prefix": prefix, "keys": keys, "redis_timeout_ms": 2000, **section}},
            {"name": "routing"},
        ],
        "upstream": {"first_byte_timeout_s": 300, "idle_timeout_s": 120},
    }


@pytest.fixture
def gateway(gateway_factory: GatewayFactory, real_worker: Any, prefix: str) -> Iterator[ServerThread]:
    with gateway_factory(gateway_config(prefix, real_worker.url, {"tokens_per_day": 100_000})) as (_, server):
        yield server


def charged(prefix: str) -> tuple[int, int]:
    """(prompt, completion) tokens charged to k1 today, once the settlement is in (it is polled)."""
    key = budgets_for(prefix, "t1", "key", "k1", Limits(), time.time())[0].redis_key
    client = redis.Redis()
    try:
        row = client.hmget(key, ["prompt_tokens", "completion_tokens"])
    finally:
        client.close()
    return int(row[0] or 0), int(row[1] or 0)


def settled(prefix: str, before: tuple[int, int]) -> tuple[int, int]:
    deadline = time.monotonic() + 30
    while True:
        now = charged(prefix)
        if now != before or time.monotonic() > deadline:
            time.sleep(0.3)  # a late correction would land here
            now = charged(prefix)
            return now[0] - before[0], now[1] - before[1]
        time.sleep(0.05)


def post(server: ServerThread, **body: Any) -> httpx.Response:
    payload = {"model": "smollm2", "messages": ASK, "temperature": 0, **body}
    return httpx.post(
        server.url + "/v1/chat/completions", json=payload, headers={"authorization": f"Bearer {KEY}"}, timeout=300
    )


def test_a_stream_without_usage_is_charged_what_vllm_counts(gateway: ServerThread, prefix: str) -> None:
    answer = post(gateway, max_tokens=48)
    assert answer.status_code == 200
    usage = answer.json()["usage"]
    assert settled(prefix, (0, 0)) == (usage["prompt_tokens"], usage["completion_tokens"])
    before = charged(prefix)
    streamed = post(gateway, max_tokens=48, stream=True)  # the same greedy request, no usage asked
    assert streamed.content.endswith(b"data: [DONE]\n\n")
    prompt, completion = settled(prefix, before)
    # the prompt is the gateway's estimate (no usage in the stream); the completion is what was sent
    assert abs(completion - usage["completion_tokens"]) <= 1, (completion, usage)
    assert prompt > 0


def test_a_stream_the_client_cuts_is_charged_for_what_went_out(gateway: ServerThread, prefix: str) -> None:
    body = {"model": "smollm2", "messages": ASK, "temperature": 0, "max_tokens": 400, "stream": True}
    read = 0
    with httpx.stream(
        "POST", gateway.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=300
    ) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                delta = orjson.loads(line[6:])["choices"][0]["delta"]
                read += 1 if delta.get("content") else 0
                if read == 6:
                    break
    _, completion = settled(prefix, (0, 0))
    assert 6 <= completion < 400


def test_without_max_tokens_the_context_is_reserved_or_max_tokens_clamped(
    gateway_factory: GatewayFactory, real_worker: Any, prefix: str
) -> None:
    limits = {"tokens_per_minute": 1000}
    with gateway_factory(gateway_config(prefix, real_worker.url, limits)) as (_, server):
        refused = post(server)  # the worst case is the whole context, 2048 > 1000
    assert refused.status_code == 429 and "Request too large" in refused.json()["error"]["message"]
    with gateway_factory(
        gateway_config(prefix + ":clamp", real_worker.url, {"tokens_per_day": 30}, without_max_tokens="clamp")
    ) as (_, server):
        clamped = post(server)
    assert clamped.status_code == 200, clamped.text
    limit = int(clamped.headers["x-gateway-max-tokens"])
    usage = clamped.json()["usage"]
    assert usage["completion_tokens"] <= limit < 30
    assert clamped.json()["choices"][0]["finish_reason"] == "length"


OTHER_KEY = "sk-gw-e2e-tenancy-other"


def prefix_hits(worker_url: str) -> float:
    """The worker's prompt tokens served from its prefix cache so far, once no request is adding to it."""
    last = -1.0
    while True:
        text = httpx.get(worker_url + "/metrics", timeout=10).text
        hits = sum(
            float(line.rsplit(" ", 1)[-1])
            for line in text.splitlines()
            if line.startswith("vllm:prefix_cache_hits_total")
        )
        if hits == last:
            return hits
        last = hits
        time.sleep(0.3)


@pytest.mark.parametrize("scope", ["tenant", "shared"])
def test_a_tenants_prompt_prefix_is_reused_for_that_tenant_only(
    gateway_factory: GatewayFactory, real_worker: Any, prefix: str, scope: str
) -> None:
    config = gateway_config(prefix, real_worker.url, {}, prefix_cache=scope)
    other = {"id": "k2", "tenant": "t2", "hash": hash_key(OTHER_KEY, PEPPER.encode())}
    config["plugins"][0]["config"]["keys"].append(other)
    # a system prompt of several KV blocks (128 tokens each on the CPU build) that no earlier run sent
    words = " ".join(f"clause {n} of the merger plan {uuid.uuid4().hex[:6]}" for n in range(40))
    body = {"model": "smollm2", "messages": [{"role": "system", "content": words}, *ASK], "max_tokens": 1}

    def reused(key: str) -> float:
        before = prefix_hits(real_worker.url)
        reply = httpx.post(
            server.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=300
        )
        assert reply.status_code == 200, reply.text
        return prefix_hits(real_worker.url) - before

    with gateway_factory(config) as (_, server):
        assert reused(KEY) == 0  # t1 sends it first
        by_other_tenant = reused(OTHER_KEY)
        by_same_tenant = reused(KEY)
    assert by_same_tenant >= 128  # the worker does reuse the prefix for the tenant that sent it
    if scope == "tenant":
        assert by_other_tenant == 0
    else:
        assert by_other_tenant >= 128
