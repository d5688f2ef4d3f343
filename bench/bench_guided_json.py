"""What guided_json costs: at the gateway (compile cache) and on the engine (constrained decoding).

Gateway part (always): one in-process gateway (guided_json + routing, probe off) in front of the fake
worker from tests/support/fakes.py, which answers a valid JSON object instantly. Sequential requests on one
keep-alive connection, median and p90 latency for: no constraint, a repeated schema (compile cache
hit), and a new schema every request (outlines compile). "added" is the median over "no constraint".

Engine part (with --worker URL, a vLLM worker serving --model): completion tokens/s with and without a
schema, the same prompt and max_tokens, through the same gateway.

    .venv/bin/python bench/bench_guided_json.py -n 300
    .venv/bin/python bench/bench_guided_json.py -n 300 --worker http://127.0.0.1:8201 --model smollm2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.ops.settings import Settings
from gateway.pipeline.config import GatewayConfig
from gateway.pipeline.registry import PluginRegistry
from gateway.server.app import create_app
from plugins.guided_json import GuidedJSONPlugin
from plugins.routing import RoutingPlugin
from tests.support.fakes import FakeUpstream, ServerThread

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}


def _gateway(worker_url: str, model: str) -> ServerThread:
    registry = PluginRegistry()
    registry.register("guided_json", GuidedJSONPlugin)
    registry.register("routing", RoutingPlugin)
    config = GatewayConfig.model_validate(
        {
            "models": [{"name": model, "workers": [worker_url]}],
            "plugins": [{"name": "guided_json", "config": {"probe": False}}, {"name": "routing"}],
            "upstream": {"first_byte_timeout_s": 300, "idle_timeout_s": 300},
        }
    )
    app = create_app(Settings(), registry=registry, config=config, engine_factory=None)
    return ServerThread(app)


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


def _latencies(client: httpx.Client, n: int, body_for: Callable[[int], dict[str, Any]]) -> list[float]:
    out = []
    for i in range(n):
        body = body_for(i)
        started = time.perf_counter()
        reply = client.post("/v1/chat/completions", json=body)
        out.append((time.perf_counter() - started) * 1000)
        if reply.status_code != 200:
            raise SystemExit(f"request failed: {reply.status_code} {reply.text[:300]}")
    return out


def gateway_part(n: int) -> None:
    fake = FakeUpstream()
    fake.behavior.text = '{"name": "Ada", "age": 36, "tags": ["math"]}'
    with ServerThread(fake) as worker, _gateway(worker.url, "m1") as gw, httpx.Client(base_url=gw.url) as client:
        base = {"model": "m1", "messages": [{"role": "user", "content": "Describe a person."}]}

        def new_schema(i: int) -> dict[str, Any]:
            schema = {
                **PERSON,
                "properties": {**PERSON["properties"], f"extra_{i}_{time.time_ns()}": {"type": "string"}},
            }
            return {**base, "response_format": _schema_format(schema)}

        _latencies(client, 50, lambda i: base)  # warm up connections and code paths
        rows = {
            "no constraint": _latencies(client, n, lambda i: base),
            "repeated schema": _latencies(client, n, lambda i: {**base, "response_format": _schema_format(PERSON)}),
            "new schema each time": _latencies(client, n, new_schema),
        }
    baseline = statistics.median(rows["no constraint"])
    print(f"\nGateway (fake worker, {n} sequential requests each)")
    print(f"{'case':<24}{'p50 ms':>10}{'p90 ms':>10}{'added p50 ms':>15}")
    for name, values in rows.items():
        p50 = statistics.median(values)
        p90 = statistics.quantiles(values, n=10)[-1]
        print(f"{name:<24}{p50:>10.3f}{p90:>10.3f}{p50 - baseline:>15.3f}")


def engine_part(worker_url: str, model: str, requests: int, max_tokens: int) -> None:
    prompt = [{"role": "user", "content": "Invent a fictional person: name, age and three tags."}]
    cases = {
        "no schema": {},
        "json_schema": {"response_format": _schema_format(PERSON)},
        "json_object": {"response_format": {"type": "json_object"}},
    }
    results = {}
    with _gateway(worker_url, model) as gw, httpx.Client(base_url=gw.url, timeout=600) as client:
        for name, extra in cases.items():
            body = {"model": model, "messages": prompt, "max_tokens": max_tokens, "temperature": 0.7, **extra}
            client.post("/v1/chat/completions", json=body)  # warm-up (and the worker's own compile)
            tokens, elapsed = 0, 0.0
            for _ in range(requests):
                started = time.perf_counter()
                reply = client.post("/v1/chat/completions", json=body)
                elapsed += time.perf_counter() - started
                if reply.status_code == 200:
                    tokens += reply.json()["usage"]["completion_tokens"]
            results[name] = (tokens, elapsed)
    print(f"\nEngine ({worker_url}, model {model}, {requests} requests each, max_tokens={max_tokens})")
    print(f"{'case':<16}{'tokens':>8}{'seconds':>10}{'tokens/s':>10}")
    for name, (tokens, elapsed) in results.items():
        print(f"{name:<16}{tokens:>8}{elapsed:>10.2f}{tokens / elapsed if elapsed else 0:>10.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=300, help="requests per gateway case")
    parser.add_argument("--worker", help="a vLLM worker URL for the engine part")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--engine-requests", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    gateway_part(args.n)
    if args.worker:
        engine_part(args.worker, args.model, args.engine_requests, args.max_tokens)


if __name__ == "__main__":
    main()
