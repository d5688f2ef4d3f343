"""Adapter-affine placement against least-outstanding without affinity, on two real vLLM CPU workers.

Two managed SmolLM2 workers with LoRA (``max_loras`` 2 each, ``--enforce-eager``) serve a workload that
mixes the base model and several adapters (made at start with peft, as tests/e2e/test_lora_with_vllm.py
does). The same requests run twice through an in-process gateway, once per placement:

- ``affinity``: the default scorers (a worker holding the adapter first, then a free slot, then load);
- ``no-affinity``: the same loader, with the affinity and free-slot weights at 0: least outstanding
  requests alone, loading wherever the request lands.

Each run starts on a cold fleet (every adapter unloaded from both workers) and first sends ``--warmup``
requests of the same mix (the same ones in both runs), whose loads are reported apart as the cold start;
then the measured requests. Printed side by side, for the measured requests only: adapter loads per 1,000
requests on the warm fleet (from ``gateway_adapter_loads_total``), TTFT p50/p99 and output tokens/s; with
the cold start's loads, the adapters each worker lists at the end, each worker's share of the measured
requests (its own ``vllm:request_success_total``) and the mean time of a load.

The mix has more adapters than one worker holds (``max_loras``) and no more than the fleet holds, so
placement decides whether they stay put or keep being swapped.

    .venv/bin/python bench/bench_lora_placement.py                 # 48 + 96 requests per run, concurrency 6
    .venv/bin/python bench/bench_lora_placement.py --requests 600  # steady numbers, about 15 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gateway.ops.settings import Settings  # noqa: E402
from gateway.pipeline.config import GatewayConfig  # noqa: E402
from gateway.pipeline.registry import PluginRegistry  # noqa: E402
from gateway.server.app import create_app  # noqa: E402
from tests.e2e.test_lora_with_vllm import NAMES, make_adapters, private_model_copy  # noqa: E402
from tests.support.fakes import ServerThread, free_port  # noqa: E402
from tests.support.gateways import ENGINE_MODEL, base_config, engine_config  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_workload import pct  # noqa: E402

RESULTS = REPO / "bench" / "results" / "lora_placement.json"
ADMIN_TOKEN = "bench-lora"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
MAX_LORAS = 2
WORKERS = 2
PLACEMENTS = {
    "affinity": {},
    "no-affinity": {"affinity_weight": 0, "free_slot_weight": 0},
}


def workload(n: int, seed: int) -> list[str]:
    """The model of each request: the base model a third of the time, else an adapter, the first ones
    more often than the last (a few hot fine-tunes and a tail)."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(len(NAMES))]
    return [ENGINE_MODEL if rng.random() < 1 / 3 else rng.choices(NAMES, weights)[0] for _ in range(n)]


def gateway_config(workers: list[str], adapters: dict[str, str], placement: dict[str, float]) -> dict[str, Any]:
    # Placement alone: no bound on the loads the one anonymous tenant causes (each scorer set gets every load).
    routing = {"adapters": {"sync_interval_s": 1, "tenant_loads_per_minute": None, **placement}}
    config = base_config(workers, plugins=[{"name": "routing", "config": routing}])
    config["models"][0] |= {
        "name": ENGINE_MODEL,
        "aliases": [],
        "adapters": [{"name": n, "path": p} for n, p in adapters.items()],
        "lora": {"max_loras": MAX_LORAS, "max_lora_rank": 8},
    }
    config["upstream"] |= {"first_byte_timeout_s": 300, "idle_timeout_s": 120}
    return config


async def one(client: httpx.AsyncClient, base: str, model: str, prompt: str) -> tuple[float, int] | None:
    """TTFT and output tokens of one streamed request; None (and the error printed) if it failed."""
    body = {
        "model": model, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    started = asyncio.get_running_loop().time()
    first, tokens = 0.0, 0
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            print(f"  {model}: {response.status_code} {(await response.aread())[:300]!r}", flush=True)
            return None
        async for line in response.aiter_lines():
            if line.startswith("data: {") and not first and '"content"' in line:
                first = asyncio.get_running_loop().time()
            if line.startswith("data: {") and '"usage"' in line and '"completion_tokens"' in line:
                tokens = json.loads(line[6:]).get("usage", {}).get("completion_tokens", tokens) or tokens
    return (first or asyncio.get_running_loop().time()) - started, tokens


async def run(base: str, models: list[str], concurrency: int, tag: str) -> dict[str, Any]:
    """Send ``models`` (one request each) ``concurrency`` at a time. ``tag`` starts every prompt, so that no
    run or phase finds another's prompts in the workers' prefix caches."""
    queue = list(enumerate(models))
    ttfts: list[float] = []
    tokens = errors = 0
    async with httpx.AsyncClient(timeout=600) as client:

        async def loop() -> None:
            nonlocal tokens, errors
            while queue:
                index, model = queue.pop(0)
                answer = await one(client, base, model, f"({tag}) Say something about the number {index}.")
                if answer is None:
                    errors += 1
                    continue
                ttfts.append(answer[0] * 1000)
                tokens += answer[1]

        started = asyncio.get_running_loop().time()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        wall = asyncio.get_running_loop().time() - started
    return {
        "ttft_p50_ms": pct(ttfts, 50), "ttft_p99_ms": pct(ttfts, 99), "tokens_per_s": tokens / wall, "errors": errors,
    }  # fmt: skip


def loads(base: str) -> float:
    text = httpx.get(base + "/metrics", headers=ADMIN, timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("gateway_adapter_loads_total{") and 'outcome="ok"' in line
    )


def metric_sum(text: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def load_ms(base: str) -> float:
    """Mean time of the gateway's adapter loads (the POST to the worker), in ms."""
    text = httpx.get(base + "/metrics", headers=ADMIN, timeout=10).text
    count = metric_sum(text, "gateway_adapter_load_seconds_count")
    return metric_sum(text, "gateway_adapter_load_seconds_sum") * 1000 / count if count else 0.0


def served(workers: list[str]) -> list[float]:
    """Requests each worker has finished, by its own count (vllm:request_success_total)."""
    return [metric_sum(httpx.get(url + "/metrics", timeout=10).text, "vllm:request_success_total") for url in workers]


def listed(workers: list[str]) -> dict[str, list[str]]:
    """The adapters each worker lists (its own word, not the gateway's)."""
    return {
        url: sorted(c["id"] for c in httpx.get(url + "/v1/models", timeout=10).json()["data"] if c.get("parent"))
        for url in workers
    }


def unload_everything(workers: list[str]) -> None:
    """A cold fleet: every adapter unloaded, and no worker listing one any more."""
    for url, names in listed(workers).items():
        for name in names:
            response = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)
            if response.status_code not in (200, 404):
                raise RuntimeError(f"unloading {name} from {url}: {response.status_code} {response.text[:300]}")
    if any(listed(workers).values()):
        raise RuntimeError(f"adapters still listed after unloading: {listed(workers)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=96, help="measured requests per run")
    parser.add_argument("--warmup", type=int, default=48, help="requests per run on the cold fleet, not measured")
    parser.add_argument("--concurrency", type=int, default=6)
    args = parser.parse_args()
    if not MAX_LORAS < len(NAMES) <= WORKERS * MAX_LORAS:
        parser.error(f"{len(NAMES)} adapters: the mix must need more than one worker and fit in the fleet")
    scratch = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    models_dir = private_model_copy(scratch)
    adapters = make_adapters(models_dir / ENGINE_MODEL, scratch / "adapters")
    ports = [free_port(), free_port()]
    engine = engine_config(ports[0])
    spec = engine["engine"]["workers"][0]
    engine["engine"]["workers"] = [
        {**spec, "name": f"lora-{i}", "port": p, "omp_threads_bind": str(i % 2), "max_num_seqs": 8}
        for i, p in enumerate(ports)
    ]
    assert len(ports) == WORKERS
    engine["models"][0] |= {"workers": ["lora-0", "lora-1"], "lora": {"max_loras": MAX_LORAS, "max_lora_rank": 8}}
    settings = Settings(model_dir=models_dir, admin_token=ADMIN_TOKEN)
    workers = [f"http://127.0.0.1:{p}" for p in ports]
    warm, models = workload(args.warmup, seed=8), workload(args.requests, seed=7)
    report: dict[str, Any] = {
        "requests": args.requests, "warmup": args.warmup, "concurrency": args.concurrency,
        "adapters": len(NAMES), "max_loras": MAX_LORAS, "workers": WORKERS, "placements": {},
    }  # fmt: skip
    engine_app = create_app(settings, registry=PluginRegistry(), config=GatewayConfig.model_validate(engine))
    with ServerThread(engine_app, start_timeout_s=1200):
        for run_no, (name, placement) in enumerate(PLACEMENTS.items(), 1):
            unload_everything(workers)
            config = GatewayConfig.model_validate(gateway_config(workers, adapters, placement))
            app = create_app(
                Settings(admin_token=ADMIN_TOKEN, managed_workers=False), registry=PluginRegistry(), config=config
            )
            with ServerThread(app) as gateway:
                cold_errors = asyncio.run(run(gateway.url, warm, args.concurrency, f"{run_no}.0"))["errors"]
                cold, before = loads(gateway.url), served(workers)
                result = asyncio.run(run(gateway.url, models, args.concurrency, f"{run_no}.1"))
                steady, after = loads(gateway.url) - cold, served(workers)
                mean_load_ms = load_ms(gateway.url)
            result |= {
                "cold_start_loads": cold, "loads": steady, "loads_per_1000": steady * 1000 / args.requests,
                "mean_load_ms": mean_load_ms, "listed_at_end": listed(workers), "cold_start_errors": cold_errors,
                "share_per_worker": [round((a - b) / args.requests, 3) for a, b in zip(after, before, strict=True)],
            }  # fmt: skip
            report["placements"][name] = result
            print(f"  {name}: {result}", flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{args.requests} measured requests per run, after {args.warmup} on the cold fleet; c={args.concurrency}")
    for name, r in report["placements"].items():
        if r["errors"]:
            print(f"  {name}: {r['errors']} measured requests failed (left out of TTFT and tokens/s)")
    print("| placement | loads / 1,000 requests | loads in the cold start | TTFT p50 ms | TTFT p99 ms | tokens/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in report["placements"].items():
        print(
            f"| {name} | {r['loads_per_1000']:.0f} | {r['cold_start_loads']:.0f} | {r['ttft_p50_ms']:.0f} | "
            f"{r['ttft_p99_ms']:.0f} | {r['tokens_per_s']:.1f} |"
        )
    for name, r in report["placements"].items():
        print(
            f"  {name}: adapters listed at the end {list(r['listed_at_end'].values())}, share of the measured "
            f"requests per worker {r['share_per_worker']}, a load took {r['mean_load_ms']:.0f} ms on average"
        )
    affine, other = (report["placements"][p]["loads"] for p in PLACEMENTS)
    print(f"  loads on the warm fleet: {affine:.0f} with affinity, {other:.0f} without", end="")
    print(f" ({other / affine:.1f}x fewer)" if affine else "")


if __name__ == "__main__":
    main()
