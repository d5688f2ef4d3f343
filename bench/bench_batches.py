"""Batches on idle capacity: does a batch slow interactive traffic, and how much of the fleet does it use?

Against workers given by URL (two real vLLM CPU workers for the issue's figures; started by hand, e.g.
with ``--scheduling-policy priority`` and ``--engine-priority 100`` here), one gateway (``gateway serve``,
routing only, its own process) and the real Redis, one run prints side by side:

1. interactive alone: streamed chat at a steady ``--rate`` for ``--duration`` s: TTFT p50/p99;
2. interactive with a batch: the same, with an ``--lines``-line batch submitted first;
3. the batch's output tokens/s with no interactive traffic (from its usage and timestamps), against the
   same lines sent straight to the workers at ``--direct-concurrency`` (their best, found beforehand).

Targets (issue 34): TTFT p99 in (2) at most 1.25x (1); batch tokens/s in (3) at least 80% of direct.

    .venv/bin/python bench/bench_batches.py --workers http://127.0.0.1:8301 http://127.0.0.1:8302 \\
        --model smollm2 --lines 1000 --rate 1 --duration 120
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import peers  # noqa: E402


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
    routing = {"default": {"admission": {"max_in_flight": args.max_in_flight, "max_queue": 256}}}
    config = {
        "models": [{"name": args.model, "workers": args.workers}],
        "plugins": [{"name": "routing", "config": routing}],
        "upstream": {"first_byte_timeout_s": 600, "idle_timeout_s": 300},
        "batches": {**batches, "worker_max_in_flight": args.worker_share, "max_in_flight": 64},
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", nargs="+", required=True, help="vLLM worker URLs")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--line-tokens", type=int, default=32, help="max_tokens of each batch line")
    parser.add_argument("--rate", type=float, default=1.0, help="interactive requests per second")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of interactive traffic per phase")
    parser.add_argument("--max-in-flight", type=int, default=16, help="routing's admission max_in_flight")
    parser.add_argument("--worker-share", type=int, default=8, help="batches.worker_max_in_flight")
    parser.add_argument("--engine-priority", type=int, help="batches.engine_priority (workers with the policy)")
    parser.add_argument("--direct-concurrency", type=int, default=16)
    args = parser.parse_args()
    salt = uuid.uuid4().hex[:6]
    with tempfile.TemporaryDirectory() as tmp, gateway(args, Path(tmp)) as url:
        alone = asyncio.run(interactive(url, args.model, args.rate, args.duration, 16))
        batch_id = submit(url, batch_lines(args.model, args.lines, args.line_tokens, salt + "a"))
        together = asyncio.run(interactive(url, args.model, args.rate, args.duration, 16))
        wait_done(url, batch_id)
        lines = batch_lines(args.model, args.lines, args.line_tokens, salt + "b")
        solo = wait_done(url, submit(url, lines))
    batch_rate = solo["usage"]["output_tokens"] / max(solo["completed_at"] - solo["in_progress_at"], 1)
    direct_rate = asyncio.run(direct(args.workers, lines, args.direct_concurrency))
    print("| measure | without batch | with batch | ratio |")
    print("|---|---|---|---|")
    for name, q in (("TTFT p50 (ms)", 50), ("TTFT p99 (ms)", 99)):
        a, b = p(alone, q) * 1000, p(together, q) * 1000
        print(f"| interactive {name} | {a:.1f} | {b:.1f} | {b / a if a else 0:.2f}x |")
    print(f"| batch output tokens/s (batch alone vs direct c={args.direct_concurrency}) "
          f"| {direct_rate:.1f} | {batch_rate:.1f} | {batch_rate / direct_rate:.0%} |")  # fmt: skip


if __name__ == "__main__":
    main()
