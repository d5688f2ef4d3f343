"""Clients that disconnect mid-stream in bulk, against a real vLLM CPU worker: the gateway closes each
upstream connection, vLLM aborts the generations, and the worker's ``vllm:num_requests_running`` drops
to 0 long before the streams would have ended by themselves (each asked for 1,000 tokens with
``ignore_eos``: minutes of decoding on the CPU)."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from tests.support.faults import wait_for
from tests.support.gateways import RealEngine

STREAMS = 12
_RUNNING = re.compile(r"^vllm:num_requests_running\{[^}]*\}\s+([0-9.e+]+)", re.M)
_WAITING = re.compile(r"^vllm:num_requests_waiting\{[^}]*\}\s+([0-9.e+]+)", re.M)


def engine_load(worker_url: str) -> tuple[float, float]:
    """(running, waiting) requests, from the worker's own /metrics."""
    text = httpx.get(worker_url + "/metrics", timeout=10).text
    running = sum(float(v) for v in _RUNNING.findall(text))
    waiting = sum(float(v) for v in _WAITING.findall(text))
    return running, waiting


async def open_streams_then_vanish(gateway_url: str, worker_url: str) -> float:
    """Open STREAMS streams, read until each has produced text, then drop every connection at once.
    Returns the engine's running count seen while they were all open."""
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}],
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    clients = [httpx.AsyncClient(base_url=gateway_url, timeout=120) for _ in range(STREAMS)]
    streams = []
    try:
        for client in clients:
            request = client.build_request("POST", "/v1/chat/completions", json=body)
            streams.append(await client.send(request, stream=True))
        for response in streams:
            assert response.status_code == 200
            chunks = response.aiter_text()
            seen = ""
            while '"content":"' not in seen.replace(": ", ":") or seen.count("data:") < 3:
                seen += await asyncio.wait_for(anext(chunks), timeout=120)
        # The engine's gauges follow its scheduler steps: poll (bounded) until they show every stream.
        seen_most = 0.0
        for _ in range(100):
            running, waiting = await asyncio.to_thread(engine_load, worker_url)
            seen_most = max(seen_most, running + waiting)
            if seen_most >= STREAMS:
                break
            await asyncio.sleep(0.1)
        return seen_most
    finally:
        # Vanish: close the sockets without reading the rest (what a client that crashes or times out does).
        for response in streams:
            await response.aclose()
        for client in clients:
            await client.aclose()


@pytest.mark.engine
@pytest.mark.slow
def test_clients_vanishing_mid_stream_in_bulk_abort_the_engine_work(real_worker: RealEngine) -> None:
    wait_for(lambda: engine_load(real_worker.url) == (0.0, 0.0), 120, "an idle engine before the test")
    in_engine = asyncio.run(open_streams_then_vanish(real_worker.gateway_url, real_worker.url))
    # Every stream had produced text, so all were in the engine; its gauges are published from the
    # stats of recent scheduler steps and lag badly on a loaded machine (as few as 1 of 12 was seen),
    # so require only that the engine was seen busy before the clients vanished.
    assert in_engine >= 1, in_engine
    # 12 x 1,000 tokens would take minutes at the worker's speed; aborted, they are gone in moments.
    wait_for(lambda: engine_load(real_worker.url) == (0.0, 0.0), 15, "vLLM to abort the abandoned streams")
    # The gateway's own books agree: nothing in flight at the worker.
    workers = real_worker.app.state.services.workers
    assert all(w.in_flight == 0 for w in workers.all())
