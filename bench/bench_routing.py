"""Routing benchmark, side by side in one run.

1. Decision cost: ``on_request`` + the first ``next_worker`` + ``finished`` of the routing plugin with
   64 workers, per policy (in-process, no network): microseconds per request.
2. With two real vLLM workers (``--workers URL,URL``, e.g. two started by hand on 8301 and 8302): a
   shared-prefix workload (many requests sharing one of a few long system prompts, interleaved) sent
   through a gateway per policy; TTFT p50/p99 and the workers' prefix-cache hit rate
   (``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries`` deltas). Each policy gets prompts with
   its own nonce so no run profits from another run's cache.

    .venv/bin/python bench/bench_routing.py                                   # decision cost only
    .venv/bin/python bench/bench_routing.py --workers http://127.0.0.1:8301,http://127.0.0.1:8302
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.app import create_app
from gateway.config import GatewayConfig, UpstreamConfig
from gateway.context import RequestContext
from gateway.metrics import Metrics
from gateway.registry import PluginRegistry
from gateway.runtime import build_snapshot
from gateway.services import Services
from gateway.settings import Settings
from gateway.upstream import UpstreamClient
from gateway.workers import WorkerTable
from plugins.routing import RoutingPlugin
from tests.fakes import ServerThread

POLICIES = ["round_robin", "least_outstanding", "prefix_affinity"]


# -- 1. decision cost ------------------------------------------------------------------------------


async def decision_cost(policy: str, n_workers: int, iterations: int, admission: bool) -> float:
    urls = [f"http://10.0.{i // 250}.{i % 250 + 1}:8000" for i in range(n_workers)]
    routing: dict[str, Any] = {"default": {"policy": policy}}
    if admission:
        routing["default"]["admission"] = {"max_in_flight": 10_000, "max_queue": 10}
    config = GatewayConfig.model_validate(
        {"models": [{"name": "m", "workers": urls}], "plugins": [{"name": "routing", "config": routing}]}
    )
    services = Services(Settings(), UpstreamClient(UpstreamConfig()), WorkerTable(), Metrics())
    services.workers.sync(urls)
    snapshot = await build_snapshot(config, PluginRegistry({"routing": RoutingPlugin}, discover=False), services)
    plugin = snapshot.pipeline.plugins[0].plugin
    rng = random.Random(7)
    for i, worker in enumerate(services.workers.all()):
        worker.in_flight = rng.randrange(0, 8) + (i % 3)
    system = [f"System prompt {k}: " + "be brief and exact. " * 60 for k in range(16)]
    bodies = [
        {"model": "m", "messages": [{"role": "system", "content": system[i % 16]}, {"role": "user", "content": "q"}]}
        for i in range(256)
    ]
    model = snapshot.models.resolve("m")
    assert model is not None
    contexts = [
        RequestContext(
            request_id="r",
            endpoint="chat/completions",
            path="/v1/chat/completions",
            body=body,
            raw_body=b"",
            headers={},
            model=model,
            requested_model="m",
            snapshot=snapshot,
            stream=False,
            started=0.0,
        )
        for body in bodies
    ]
    started = time.perf_counter()
    for i in range(iterations):
        ctx = contexts[i % len(contexts)]
        await plugin.on_request(ctx)
        plan = ctx.plan
        assert plan is not None
        worker = plan.next_worker(None, None)
        assert worker is not None
        plan.finished(worker, ok=True)
    elapsed = time.perf_counter() - started
    await snapshot.pipeline.aclose()
    await services.aclose()
    return elapsed / iterations * 1e6


# -- 2. real workers -------------------------------------------------------------------------------


async def prefix_counters(client: httpx.AsyncClient, urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in urls:
        text = (await client.get(url + "/metrics")).text
        for line in text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[-1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[-1])
    return hits, queries


def workload(nonce: str, prompts: int, repeats: int, prompt_words: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "epsilon",
        "zeta",
        "eta",
        "theta",
        "iota",
        "kappa",
        "lambda",
        "mu",
        "nu",
        "xi",
        "omicron",
        "pi",
        "rho",
    ]
    systems = [
        f"[{nonce}-{k}] You are assistant {k}. " + " ".join(rng.choice(words) for _ in range(prompt_words))
        for k in range(prompts)
    ]
    requests = [
        {
            "model": "smollm2",
            "messages": [
                {"role": "system", "content": systems[k]},
                {"role": "user", "content": f"Question {r}: name one colour."},
            ],
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
        }
        for k in range(prompts)
        for r in range(repeats)
    ]
    rng.shuffle(requests)
    return requests


async def run_policy(policy: str, worker_urls: list[str], args: argparse.Namespace) -> dict[str, float]:
    config = {
        "models": [{"name": "smollm2", "workers": worker_urls}],
        "plugins": [{"name": "routing", "config": {"default": {"policy": policy, "load_factor": args.load_factor}}}],
        "upstream": {"first_byte_timeout_s": 300, "idle_timeout_s": 300},
    }
    app = create_app(
        Settings(),
        registry=PluginRegistry({"routing": RoutingPlugin}, discover=False),
        config=GatewayConfig.model_validate(config),
        engine_factory=None,
    )
    requests = workload(uuid.uuid4().hex[:8], args.prompts, args.repeats, args.prompt_words, args.seed)
    ttfts: list[float] = []
    with ServerThread(app) as server:
        async with httpx.AsyncClient(timeout=600) as client:
            before = await prefix_counters(client, worker_urls)
            queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
            for body in requests:
                queue.put_nowait(body)

            async def user() -> None:
                while not queue.empty():
                    body = queue.get_nowait()
                    started = time.perf_counter()
                    async with client.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
                        first = None
                        async for line in r.aiter_lines():
                            if first is None and line.startswith("data: {"):
                                first = time.perf_counter() - started
                        if r.status_code != 200 or first is None:
                            raise RuntimeError(f"request failed: HTTP {r.status_code}")
                        ttfts.append(first)

            await asyncio.gather(*(user() for _ in range(args.concurrency)))
            after = await prefix_counters(client, worker_urls)
    hits, queries = after[0] - before[0], after[1] - before[1]
    ttfts.sort()
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "ttft_p50_ms": statistics.median(ttfts) * 1000,
        "ttft_p99_ms": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))] * 1000,
        "requests": len(ttfts),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", help="comma-separated URLs of two (or more) real vLLM workers")
    parser.add_argument("--iterations", type=int, default=20_000)
    parser.add_argument("--prompts", type=int, default=12, help="distinct shared system prompts")
    parser.add_argument("--repeats", type=int, default=4, help="requests per system prompt")
    parser.add_argument("--prompt-words", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--load-factor", type=float, default=1.25, help="bounded-load factor for affinity")
    args = parser.parse_args()

    print("routing decision cost, 64 workers (on_request + next_worker + finished)")
    print(f"{'policy':<20}{'us/request':>12}{'with admission':>16}")
    for policy in [*POLICIES, "session_affinity"]:
        plain = await decision_cost(policy, 64, args.iterations, admission=False)
        gated = await decision_cost(policy, 64, args.iterations, admission=True)
        print(f"{policy:<20}{plain:>12.1f}{gated:>16.1f}")

    if not args.workers:
        return
    urls = [u.rstrip("/") for u in args.workers.split(",")]
    n = args.prompts * args.repeats
    print(
        f"\nshared-prefix workload: {args.prompts} system prompts x {args.repeats} requests ({n}), "
        f"~{args.prompt_words} words each, concurrency {args.concurrency}, {len(urls)} workers, "
        f"load factor {args.load_factor:g}"
    )
    print(f"{'policy':<20}{'prefix hit rate':>16}{'TTFT p50 ms':>14}{'TTFT p99 ms':>14}")
    results = {}
    for policy in POLICIES:
        results[policy] = r = await run_policy(policy, urls, args)
        print(f"{policy:<20}{r['hit_rate']:>16.3f}{r['ttft_p50_ms']:>14.0f}{r['ttft_p99_ms']:>14.0f}")
    rr, pa = results["round_robin"], results["prefix_affinity"]
    ratio = pa["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf")
    print(f"\nprefix_affinity / round_robin hit rate: {ratio:.2f}x (target >= 1.5x)")


if __name__ == "__main__":
    asyncio.run(main())
