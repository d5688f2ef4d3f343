"""With two real vLLM CPU workers: prefix affinity raises the prefix-cache hit rate the workers report
(``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``) compared with round robin.

The workers (the ``two_workers`` fixture in ``tests/e2e/conftest.py``) are managed workers started by a
gateway's lifespan (``gateway.engine``); set ``ROUTING_TEST_WORKERS=http://127.0.0.1:8301,http://127.0.0.1:8302``
to use workers started by hand.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

import httpx
import pytest

from tests.support.gateways import GatewayFactory

pytestmark = pytest.mark.engine


def prefix_counters(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in urls:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[-1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[-1])
    return hits, queries


def shared_prefix_requests(prompts: int, repeats: int) -> list[dict[str, Any]]:
    nonce = uuid.uuid4().hex[:8]  # no run profits from the cache another run left behind
    rng = random.Random(3)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    systems = [f"[{nonce}-{k}] You are assistant {k}. " + " ".join(rng.choices(words, k=150)) for k in range(prompts)]
    bodies = [
        {
            "model": "smollm2",
            "messages": [{"role": "system", "content": s}, {"role": "user", "content": f"Say {r}."}],
            "max_tokens": 2,
            "temperature": 0,
        }
        for s in systems
        for r in range(repeats)
    ]
    rng.shuffle(bodies)
    return bodies


def hit_rate(gateway_factory: GatewayFactory, urls: list[str], policy: str) -> float:
    config = {
        "models": [{"name": "smollm2", "workers": urls}],
        "plugins": [{"name": "routing", "config": {"default": {"policy": policy}}}],
        "upstream": {"first_byte_timeout_s": 300, "idle_timeout_s": 120},
    }
    before = prefix_counters(urls)
    with gateway_factory(config) as (_, gw), httpx.Client(base_url=gw.url, timeout=300) as http:
        for body in shared_prefix_requests(prompts=6, repeats=3):
            assert http.post("/v1/chat/completions", json=body).status_code == 200
    after = prefix_counters(urls)
    queries = after[1] - before[1]
    assert queries > 0
    return (after[0] - before[0]) / queries


def test_prefix_affinity_raises_the_prefix_cache_hit_rate(
    gateway_factory: GatewayFactory, two_workers: list[str]
) -> None:
    round_robin = hit_rate(gateway_factory, two_workers, "round_robin")
    affinity = hit_rate(gateway_factory, two_workers, "prefix_affinity")
    # 6 prefixes x 3 requests: affinity misses each prefix once; round robin about 1.75 times.
    assert affinity > round_robin
