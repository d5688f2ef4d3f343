"""Batches on idle capacity: does a batch slow interactive traffic, and how much of the fleet does it use?

Against two vLLM CPU workers, one gateway (``gateway serve``, routing only, its own process) and the real
Redis, one run prints side by side:

1. interactive alone: streamed chat at a steady ``--rate`` for ``--duration`` s: TTFT p50/p99;
2. interactive with a batch: the same, with an ``--lines``-line batch submitted first (how many of its
   lines were done when the window closed is printed: the batch must outlast the window to count);
3. the batch's output tokens/s with no interactive traffic (from its usage and timestamps), against the
   same lines sent straight to the workers at their best concurrency: each of ``--direct-concurrency`` is
   tried on the first ``--probe-lines`` lines, and all the lines are sent at the fastest.

Targets (issue 34): TTFT p99 in (2) at most 1.25x (1); batch tokens/s in (3) at least 80% of direct.

``--managed-workers`` starts the two workers itself through the gateway's engine manager (the model
prepared in ``models/``, served as ``smollm2``, ``enforce_eager``, ``--scheduling-policy priority``, each
worker's OpenMP threads bound to its own core, a ``--kv-cache-mb`` cache each) and sets
``batches.engine_priority`` to ``--engine-priority`` (100 unless given). ``--workers URL URL`` uses workers
started by hand instead (give ``--engine-priority`` only if they run the priority policy). It starts real
workers: run it alone on the machine.

    flock /tmp/heavy.lock .venv/bin/python bench/bench_batches.py --managed-workers --lines 1000
    .venv/bin/python bench/bench_batches.py --workers http://127.0.0.1:8301 http://127.0.0.1:8302 \\
        --engine-priority 100 --lines 1000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))
import peers  # noqa: E402

from gateway.engine.model_prep import prepare_model  # noqa: E402
from gateway.engine.spec import ManagedWorkerSpec  # noqa: E402
from gateway.engine.supervisor import EngineManager  # noqa: E402

MODEL = "smollm2"


@contextlib.asynccontextmanager
async def managed_workers(kv_mb: int, max_num_seqs: int) -> AsyncIterator[list[str]]:
    """Two vLLM CPU workers serving ``smollm2`` with the priority policy, one core each, started and
    stopped by the engine manager."""
    models_dir = REPO / "models"
    await asyncio.to_thread(prepare_model, MODEL, models_dir)
    cores = os.cpu_count() or 1
    specs = [
        ManagedWorkerSpec(
            name=f"bench-batches-{i}",
            model=MODEL,
            served_model_name=MODEL,
            port=peers.free_port(),
            dtype="bfloat16",
            max_model_len=1024,
            max_num_seqs=max_num_seqs,
            enforce_eager=True,
            omp_threads_bind=str(i % cores),
            extra_args=["--scheduling-policy", "priority", "--kv-cache-memory-bytes", str(kv_mb << 20)],
        )
        for i in range(2)
    ]
    engine = EngineManager(specs, models_dir, ready_timeout_s=900, progress=lambda m: print(f"[model] {m}"))
    started = time.perf_counter()
    async with engine:
        print(f"two managed workers ready in {time.perf_counter() - started:.0f} s", flush=True)
        yield [spec.url for spec in specs]


def batch_lines(model: str, n: int, max_tokens: int, salt: str) -> list[dict[str, Any]]:
    system = "You label product reviews as positive, negative or mixed, then say why in a few words."
    return [
        {"custom_id": f"{salt}-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                  "messages": [{"role": "system", "content": system},
                               {"role": "user", "content": f"Review {i}: it arrived late but works well."}]}}
        for i in range(n)
    ]  # fmt: skip


@contextlib.contextmanager
def gateway(args: argparse.Namespace, tmp: Path) -> Iterator[str]:
    batches: dict[str, Any] = {"files_dir": str(tmp / "files"), "redis_prefix": f"bench:batch:{uuid.uuid4().hex[:8]}"}
    if args.engine_priority is not None:
        batches["engine_priority"] = args.engine_priority
    batches["admission_share"] = args.admission_share
    batches["busy_lines_per_worker"] = args.busy_lines
    batches["interactive_quiet_s"] = args.quiet_s
    routing = {"default": {"admission": {"max_in_flight": args.max_in_flight, "max_queue": 256}}}
    config = {
        "models": [{"name": args.model, "workers": args.workers}],
        "plugins": [{"name": "routing", "config": routing}],
        "upstream": {"first_byte_timeout_s": 600, "idle_timeout_s": 300},
        "batches": {**batches, "worker_max_in_flight": args.worker_share, "max_in_flight": 64, "poll_interval_s": 0.2},
    }
    path = tmp / "config.yaml"
    path.write_bytes(orjson.dumps(config))
    port = peers.free_port()
    log = tmp / "gateway.log"
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen([*cmd, "--no-managed-workers"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        peers.wait_ready(url + "/ready", proc, log)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        drop_keys(batches["redis_prefix"])


def drop_keys(prefix: str) -> None:
    """Delete the run's keys from Redis (batches, lines, results, files' metadata)."""
    import redis

    client = redis.Redis()
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


async def interactive(url: str, model: str, rate: float, duration_s: float, max_tokens: int) -> list[float]:
    """Streamed chat requests started every 1/rate s for duration_s; the TTFT of each (s)."""
    ttfts: list[float] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": f"Interactive question {i}: name a fruit."}]}  # fmt: skip
        started = time.perf_counter()
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as reply:
            first = True
            async for line in reply.aiter_lines():
                if first and line.startswith("data: ") and '"content"' in line:
                    ttfts.append(time.perf_counter() - started)
                    first = False

    async with httpx.AsyncClient(timeout=600) as client:
        tasks = []
        for i in range(int(rate * duration_s)):
            tasks.append(asyncio.create_task(one(client, i)))
            await asyncio.sleep(1 / rate)
        await asyncio.gather(*tasks)
    return ttfts


def submit(url: str, lines: list[dict[str, Any]]) -> str:
    data = b"".join(orjson.dumps(line) + b"\n" for line in lines)
    source = httpx.post(url + "/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"}).json()
    body = {"input_file_id": source["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    return str(httpx.post(url + "/v1/batches", json=body).json()["id"])


def wait_done(url: str, batch_id: str) -> dict[str, Any]:
    while True:
        batch: dict[str, Any] = httpx.get(f"{url}/v1/batches/{batch_id}").json()
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(1)


async def direct(workers: list[str], lines: list[dict[str, Any]], concurrency: int) -> float:
    """Output tokens/s of the lines sent straight to the workers (round robin) at ``concurrency``."""
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for line in lines:
        queue.put_nowait(line["body"])
    tokens = 0

    async def worker(client: httpx.AsyncClient, k: int) -> None:
        nonlocal tokens
        while not queue.empty():
            body = queue.get_nowait()
            reply = await client.post(workers[k % len(workers)] + "/v1/chat/completions", json=body)
            tokens += reply.json()["usage"]["completion_tokens"]

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(worker(client, k) for k in range(concurrency)))
    return tokens / (time.perf_counter() - started)


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else (values or [0.0])[0]


def get_batch(url: str, batch_id: str) -> dict[str, Any]:
    batch: dict[str, Any] = httpx.get(f"{url}/v1/batches/{batch_id}").json()
    return batch


async def best_direct(args: argparse.Namespace, workers: list[str], lines: list[dict[str, Any]]) -> tuple[int, float]:
    """The concurrency (of ``--direct-concurrency``) that sends the first ``--probe-lines`` lines fastest,
    then the output tokens/s of all the lines at it."""
    probes = {}
    for concurrency in args.direct_concurrency:
        probes[concurrency] = await direct(workers, lines[: args.probe_lines], concurrency)
        print(f"direct probe: c={concurrency} {probes[concurrency]:.1f} tokens/s", flush=True)
    best = max(probes, key=lambda c: probes[c])
    return best, await direct(workers, lines, best)


async def run(args: argparse.Namespace) -> None:
    salt = uuid.uuid4().hex[:6]
    async with contextlib.AsyncExitStack() as stack:
        if args.managed_workers:
            workers = await stack.enter_async_context(managed_workers(args.kv_cache_mb, args.max_num_seqs))
            if args.engine_priority is None:
                args.engine_priority = 100
        else:
            workers = args.workers
        args.workers = workers
        with tempfile.TemporaryDirectory() as tmp, gateway(args, Path(tmp)) as url:
            await interactive(url, args.model, args.rate, min(args.duration, 10), 16)  # warm up, not counted
            alone = await interactive(url, args.model, args.rate, args.duration, 16)
            print(f"interactive alone: {len(alone)} requests", flush=True)
            first = batch_lines(args.model, args.lines, args.line_tokens, salt + "a")
            batch_id = await asyncio.to_thread(submit, url, first)
            together = await interactive(url, args.model, args.rate, args.duration, 16)
            during = (await asyncio.to_thread(get_batch, url, batch_id))["request_counts"]
            print(f"interactive with the batch: {len(together)} requests; batch lines done by then: "
                  f"{during['completed'] + during['failed']} of {during['total']}", flush=True)  # fmt: skip
            await asyncio.to_thread(wait_done, url, batch_id)
            lines = batch_lines(args.model, args.lines, args.line_tokens, salt + "b")
            solo = await asyncio.to_thread(wait_done, url, await asyncio.to_thread(submit, url, lines))
        best, direct_rate = await best_direct(args, workers, lines)
    counts = solo["request_counts"]
    took = solo["completed_at"] - solo["in_progress_at"]
    print(f"batch alone: {counts['completed']} completed, {counts['failed']} failed, {took} s, "
          f"{solo['usage']['output_tokens']} output tokens")  # fmt: skip
    batch_rate = solo["usage"]["output_tokens"] / max(took, 1)
    print("| measure | without batch | with batch | ratio |")
    print("|---|---|---|---|")
    for name, q in (("TTFT p50 (ms)", 50), ("TTFT p99 (ms)", 99)):
        a, b = p(alone, q) * 1000, p(together, q) * 1000
        print(f"| interactive {name} | {a:.1f} | {b:.1f} | {b / a if a else 0:.2f}x |")
    print(f"| output tokens/s: straight to the workers (best c={best}) vs the batch alone "
          f"| {direct_rate:.1f} | {batch_rate:.1f} | {batch_rate / direct_rate:.1%} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--workers", nargs="+", help="vLLM worker URLs (started by hand)")
    where.add_argument("--managed-workers", action="store_true", help="start two CPU workers (see above)")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--kv-cache-mb", type=int, default=96, help="managed workers: KV cache of each (MiB)")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="managed workers: --max-num-seqs")
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--line-tokens", type=int, default=16, help="max_tokens of each batch line")
    parser.add_argument("--rate", type=float, default=1.0, help="interactive requests per second")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of interactive traffic per phase")
    parser.add_argument("--max-in-flight", type=int, default=16, help="routing's admission max_in_flight")
    parser.add_argument("--admission-share", type=float, default=0.5, help="batches.admission_share")
    parser.add_argument("--worker-share", type=int, default=8, help="batches.worker_max_in_flight")
    parser.add_argument("--busy-lines", type=int, default=1, help="batches.busy_lines_per_worker")
    parser.add_argument("--quiet-s", type=float, default=2.0, help="batches.interactive_quiet_s")
    parser.add_argument("--engine-priority", type=int, help="batches.engine_priority (workers with the policy)")
    parser.add_argument("--direct-concurrency", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--probe-lines", type=int, default=200, help="lines each direct concurrency is tried on")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
