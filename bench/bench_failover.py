"""Mid-stream failover: 16 paced streams through the gateway over two fake workers (real processes), one
worker SIGKILLed halfway through. Run once with stream resumption on (``stream_resumptions: 1``, the
default) and once with it off (today's behaviour before failover: a cut stream ends with one error event),
side by side in one run.

Reported per mode: streams that completed (``[DONE]``, no error event, the whole text), and for the streams
that were on the killed worker, the gap at the resumption point (the longest pause between two events of
that stream: kill -> reset -> continuation request -> first continued event) as p50/p99, against the
normal pacing between events.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_failover.py [--streams 16] [--chunks 40] [--pace-ms 50]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import statistics
import time
from typing import Any

import httpx
import orjson

from gateway.ops.settings import Settings
from gateway.pipeline.config import GatewayConfig
from gateway.pipeline.registry import PluginRegistry
from gateway.server.app import create_app
from tests.support.fakes import ServerThread
from tests.support.faults import WorkerProcess
from tests.support.gateways import base_config


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_stream(client: httpx.AsyncClient, url: str, chunks: int) -> dict[str, Any]:
    body = {"model": "m1", "messages": [{"role": "user", "content": "go"}], "stream": True, "max_tokens": chunks}
    arrivals: list[float] = []
    payloads: list[bytes] = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                arrivals.append(time.perf_counter())
                payloads.append(line[6:].encode())
    text, errors = [], 0
    for payload in payloads:
        if payload == b"[DONE]":
            continue
        event = orjson.loads(payload)
        if "error" in event:
            errors += 1
        for choice in event.get("choices") or ():
            text.append(choice.get("delta", {}).get("content") or "")
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return {
        "done": bool(payloads) and payloads[-1] == b"[DONE]",
        "errors": errors,
        "text": "".join(text),
        "arrivals": arrivals,
        "gaps": gaps,
    }


async def run_mode(resumptions: int, streams: int, chunks: int, pace_s: float) -> dict[str, Any]:
    text = "".join(f"w{i:03d} " for i in range(chunks))  # one 5-character piece per chunk
    doomed = WorkerProcess(chunks=chunks, pace_s=pace_s, text=text)
    survivor = WorkerProcess(chunks=chunks, pace_s=pace_s, text=text)
    config = base_config(
        [doomed.url, survivor.url],
        plugins=[{"name": "routing", "config": {"default": {"policy": "round_robin"}}}],
        upstream={
            "connect_timeout_s": 1,
            "first_byte_timeout_s": 5,
            "idle_timeout_s": 5,
            "health_interval_s": 0.5,
            "stream_resumptions": resumptions,
        },
    )
    app = create_app(
        Settings(), registry=PluginRegistry(), config=GatewayConfig.model_validate(config), engine_factory=None
    )
    with doomed, survivor, ServerThread(app) as gateway:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=streams * 2)) as client:
            tasks = [asyncio.create_task(one_stream(client, gateway.url, chunks)) for _ in range(streams)]
            await asyncio.sleep(pace_s * chunks / 2)
            killed_at = time.perf_counter()
            await asyncio.to_thread(doomed.kill)
            results = await asyncio.gather(*tasks)
    completed = sum(1 for r in results if r["done"] and not r["errors"] and r["text"] == text)
    # The streams that were on the killed worker: a pause that spans the kill.
    cut_gaps = []
    normal_gaps = []
    for r in results:
        arrivals = r["arrivals"]
        for i, gap in enumerate(r["gaps"]):
            if arrivals[i] <= killed_at <= arrivals[i + 1]:
                cut_gaps.append(gap)
            elif i > 0:  # after the first event (the role delta comes at once)
                normal_gaps.append(gap)
    return {
        "stream_resumptions": resumptions,
        "streams": streams,
        "completed": completed,
        "cut_streams_with_error_event": sum(1 for r in results if r["errors"]),
        "resumption_gap_ms": {
            "p50": round(percentile(cut_gaps, 0.5) * 1000, 1),
            "p99": round(percentile(cut_gaps, 0.99) * 1000, 1),
            "n": len(cut_gaps),
        },
        "normal_gap_ms": {"p50": round(statistics.median(normal_gaps) * 1000, 1) if normal_gaps else None},
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--pace-ms", type=float, default=50)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    rows = []
    for resumptions in (1, 0):
        rows.append(await run_mode(resumptions, args.streams, args.chunks, args.pace_ms / 1000))
    print(json.dumps(rows, indent=2))
    print()
    print(f"{'mode':<28}{'completed':>12}{'gap p50 ms':>12}{'gap p99 ms':>12}{'pacing p50 ms':>15}")
    for row in rows:
        mode = "failover (resumptions 1)" if row["stream_resumptions"] else "before (resumptions 0)"
        gap = row["resumption_gap_ms"]
        completed = f"{row['completed']}/{row['streams']}"
        pacing = row["normal_gap_ms"]["p50"]
        print(f"{mode:<28}{completed:>12}{gap['p50']:>12}{gap['p99']:>12}{pacing:>15}")


if __name__ == "__main__":
    asyncio.run(main())
