"""Workers failing under load, as real processes on loopback: killed (SIGKILL) during plain requests and
during streams, a worker that accepts connections and never answers, and a slow worker.

What must hold: a plain request that fails before its first byte is retried on another worker and
succeeds; a stream cut by a dying worker is continued on the survivor and completes (with stream
resumption off, it ends with exactly one OpenAI-shaped error event and ``[DONE]``);
no request waits longer than the configured bounds; a dead or silent worker is taken out of rotation;
a slow worker delays only its own requests.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import orjson

from gateway.server.app import GatewayApp
from tests.support.faults import BlackHole, WorkerProcess, check_openai_error, error_events, sse_events, wait_for
from tests.support.gateways import GatewayFactory, base_config

BODY = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}


def config(workers: list[str], *, policy: str = "least_outstanding", **upstream: Any) -> dict[str, Any]:
    routing = {"default": {"policy": policy}, "max_attempts": 3}
    timeouts = {"connect_timeout_s": 1, "first_byte_timeout_s": 5, "idle_timeout_s": 3, "health_interval_s": 0.3}
    return base_config(workers, plugins=[{"name": "routing", "config": routing}], upstream={**timeouts, **upstream})


def available(app: GatewayApp, url: str) -> bool:
    return app.state.services.workers.get(url).available()


async def post_all(url: str, count: int, body: dict[str, Any], timeout_s: float) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=count)) as client:
        return list(await asyncio.gather(*(client.post(url + "/v1/chat/completions", json=body) for _ in range(count))))


def test_worker_killed_during_plain_requests_every_request_succeeds(gateway_factory: GatewayFactory) -> None:
    # Each answer takes 0.4 s, so the kill lands while dozens of requests are inside the worker.
    doomed, survivor = WorkerProcess(delay_s=0.4), WorkerProcess(delay_s=0.4)
    with doomed, survivor, gateway_factory(config([doomed.url, survivor.url])) as (app, server):
        killer = threading.Timer(0.2, doomed.kill)
        killer.start()
        first = asyncio.run(post_all(server.url, 48, BODY, timeout_s=20))
        killer.join()
        then = asyncio.run(post_all(server.url, 24, BODY, timeout_s=20))
        wait_for(lambda: not available(app, doomed.url), 10, "the killed worker to leave rotation")
        retries = app.state.services.metrics.registry.get_sample_value(
            "gateway_upstream_retries_total", {"model": "m1"}
        )
    assert [r.status_code for r in first + then] == [200] * 72, [r.text for r in first + then if r.status_code != 200]
    assert all(r.json()["choices"][0]["message"]["content"] for r in first + then)
    assert retries and retries >= 1  # some requests were inside the killed worker and went elsewhere


def read_stream(url: str, results: list[tuple[int, list[bytes]]], lock: threading.Lock) -> None:
    body = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=15) as response:
        text = "".join(response.iter_text())
    with lock:
        results.append((response.status_code, sse_events(text)))


def killed_during_streams(gateway_factory: GatewayFactory, resumptions: int) -> list[tuple[int, list[bytes]]]:
    """16 streams over two workers (20 chunks 0.1 s apart, same text), one worker SIGKILLed midway."""
    doomed = WorkerProcess(chunks=20, pace_s=0.1, text="x" * 40)
    survivor = WorkerProcess(chunks=20, pace_s=0.1, text="x" * 40)
    cfg = config([doomed.url, survivor.url], policy="round_robin", stream_resumptions=resumptions)
    with doomed, survivor, gateway_factory(cfg) as (_, server):
        results: list[tuple[int, list[bytes]]] = []
        lock = threading.Lock()
        readers = [threading.Thread(target=read_stream, args=(server.url, results, lock)) for _ in range(16)]
        for reader in readers:
            reader.start()
        time.sleep(0.8)
        doomed.kill()
        for reader in readers:
            reader.join(timeout=30)
        assert not any(r.is_alive() for r in readers), "a stream hangs after its worker died"
    assert len(results) == 16
    for status, events in results:
        assert status == 200
        assert events[-1] == b"[DONE]"
        assert b"[DONE]" not in events[:-1]
    return results


def test_worker_killed_during_streams_every_stream_completes(gateway_factory: GatewayFactory) -> None:
    for _, events in killed_during_streams(gateway_factory, resumptions=1):
        assert error_events(events) == []
        chunks = [orjson.loads(e) for e in events[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text == "x" * 40  # whole, whether or not it was continued on the survivor
        assert len({c["id"] for c in chunks}) == 1
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
        assert chunks[-1]["usage"]["completion_tokens"] == 20


def test_worker_killed_during_streams_without_resumption_each_cut_stream_ends_with_one_error(
    gateway_factory: GatewayFactory,
) -> None:
    cut = complete = 0
    for _, events in killed_during_streams(gateway_factory, resumptions=0):
        errors = error_events(events)
        if errors:
            assert len(errors) == 1, errors
            check_openai_error({"error": errors[0]})
            assert errors[0]["type"] == "server_error"
            cut += 1
        else:
            chunks = [orjson.loads(e) for e in events[:-1]]
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            assert text == "x" * 40  # every complete stream came whole from the survivor
            complete += 1
    assert cut >= 1 and complete >= 1, (cut, complete)


def test_worker_that_never_answers_is_bounded_and_ejected(gateway_factory: GatewayFactory) -> None:
    with BlackHole() as silent, WorkerProcess() as healthy:
        cfg = config([silent.url, healthy.url], policy="round_robin", first_byte_timeout_s=1)
        with gateway_factory(cfg) as (app, server):
            started = time.monotonic()
            replies = asyncio.run(post_all(server.url, 8, BODY, timeout_s=30))
            took = time.monotonic() - started
            wait_for(lambda: not available(app, silent.url), 10, "the silent worker to leave rotation")
            after = asyncio.run(post_all(server.url, 8, BODY, timeout_s=30))
        # The silent worker alone: a 504 in OpenAI's shape after the first-byte bound, never a hang.
        only_silent = config([silent.url], first_byte_timeout_s=1)
        with gateway_factory(only_silent) as (_, server):
            started_alone = time.monotonic()
            alone = httpx.post(server.url + "/v1/chat/completions", json=BODY, timeout=30)
            took_alone = time.monotonic() - started_alone
    assert [r.status_code for r in replies + after] == [200] * 16
    # Bounds from the config, not speed targets: one first-byte timeout per try, then the retry.
    assert took < 1 * 3 + 2, took
    assert alone.status_code in (503, 504)
    error = check_openai_error(alone.json())
    assert error["code"] in ("upstream_timeout", "no_healthy_worker")
    assert took_alone < 3 * 1 + 2, took_alone


def test_slow_worker_does_not_block_requests_to_other_workers(gateway_factory: GatewayFactory) -> None:
    slow, fast = WorkerProcess(delay_s=3, text="slow"), WorkerProcess(text="fast")
    with slow, fast, gateway_factory(config([slow.url, fast.url], policy="round_robin")) as (_, server):
        done: list[tuple[str, float]] = []

        async def run() -> None:
            async with httpx.AsyncClient(timeout=20, limits=httpx.Limits(max_connections=40)) as client:

                async def one() -> None:
                    reply = await client.post(server.url + "/v1/chat/completions", json=BODY)
                    assert reply.status_code == 200, reply.text
                    done.append((reply.json()["choices"][0]["message"]["content"], time.monotonic()))

                await asyncio.gather(*(one() for _ in range(40)))

        asyncio.run(run())
    by_worker = {name: [t for n, t in done if n == name] for name in ("slow", "fast")}
    assert len(by_worker["slow"]) >= 5 and len(by_worker["fast"]) >= 5, {k: len(v) for k, v in by_worker.items()}
    # Order, not speed: every request the fast worker served was answered before the slow worker's first.
    assert max(by_worker["fast"]) < min(by_worker["slow"])
