"""What hot reload and tracing cost a running gateway, side by side in one run.

One gateway (in-process uvicorn thread) in front of the test fake worker; client threads send
non-streamed chat requests for ``--seconds`` per scenario:

- steady: no reloads, tracing off (the default);
- reloading: a new config (``PUT /admin/config``) every ``--every-ms`` while requests flow;
- tracing on: every span recorded (batch processor, in-memory exporter: the cost of building spans,
  not of the network).

Prints requests/s, latency p50/p99, failed requests, and the reload latency (prepare + swap, as the
admin client sees it).

    .venv/bin/python bench/bench_admin_reload.py --seconds 5 --clients 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.ops.settings import Settings
from gateway.ops.tracing import Tracing
from gateway.pipeline.config import GatewayConfig
from gateway.pipeline.registry import PluginRegistry
from gateway.server.app import create_app
from tests.support.fakes import FakeUpstream, ServerThread

TOKEN = "bench-admin-token"
CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}


def config(worker: str, alias: int) -> dict[str, Any]:
    return {
        "models": [{"name": "m1", "aliases": [f"alias-{alias}"], "workers": [worker]}],
        "plugins": [{"name": "routing"}],
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def scenario(worker: str, *, seconds: float, clients: int, every_ms: float | None, tracing: bool) -> dict[str, Any]:
    app = create_app(
        Settings(admin_token=TOKEN),
        registry=PluginRegistry(),
        config=GatewayConfig.model_validate(config(worker, 0)),
        engine_factory=None,
    )
    if tracing:
        app.state.services.tracing = Tracing.with_exporter(InMemorySpanExporter(), batch=True)
    latencies: list[float] = []
    failed = 0
    reloads: list[float] = []
    stop = threading.Event()
    lock = threading.Lock()
    with ServerThread(app) as server:

        def client() -> None:
            nonlocal failed
            mine: list[float] = []
            bad = 0
            with httpx.Client(base_url=server.url, timeout=10) as http:
                while not stop.is_set():
                    started = time.perf_counter()
                    r = http.post("/v1/chat/completions", json=CHAT)
                    mine.append(time.perf_counter() - started)
                    bad += r.status_code != 200
            with lock:
                latencies.extend(mine)
                failed += bad

        threads = [threading.Thread(target=client) for _ in range(clients)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + seconds
        generation = 0
        with httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {TOKEN}"}) as admin:
            while time.monotonic() < deadline:
                if every_ms is None:
                    time.sleep(0.05)
                    continue
                time.sleep(every_ms / 1000)
                generation += 1
                started = time.perf_counter()
                r = admin.put("/admin/config", content=orjson.dumps(config(worker, generation)))
                reloads.append(time.perf_counter() - started)
                assert r.status_code == 200, r.text
        stop.set()
        for t in threads:
            t.join()
    return {
        "req/s": len(latencies) / seconds,
        "p50 ms": statistics.median(latencies) * 1000,
        "p99 ms": percentile(latencies, 0.99) * 1000,
        "failed": failed,
        "reloads": len(reloads),
        "reload p50 ms": statistics.median(reloads) * 1000 if reloads else float("nan"),
        "reload max ms": max(reloads) * 1000 if reloads else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--every-ms", type=float, default=100)
    args = parser.parse_args()
    with ServerThread(FakeUpstream()) as worker:
        rows = {
            "steady": scenario(worker.url, seconds=args.seconds, clients=args.clients, every_ms=None, tracing=False),
            f"reload every {args.every_ms:g} ms": scenario(
                worker.url, seconds=args.seconds, clients=args.clients, every_ms=args.every_ms, tracing=False
            ),
            "tracing on": scenario(worker.url, seconds=args.seconds, clients=args.clients, every_ms=None, tracing=True),
        }
    columns = list(next(iter(rows.values())))
    print(f"{'scenario':<22}" + "".join(f"{c:>15}" for c in columns))
    for name, row in rows.items():
        print(f"{name:<22}" + "".join(f"{row[c]:>15.1f}" for c in columns))


if __name__ == "__main__":
    main()
