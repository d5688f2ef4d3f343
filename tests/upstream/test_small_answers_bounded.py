"""The gateway's own calls to a worker (``UpstreamClient.get`` for /health, /v1/models, /metrics, /version;
the adapter loader's POSTs) read at most ``upstream.max_small_answer_bytes``: a worker that answers more
fails that call, where the caller already handles a failed call, and the rest of its answer is not read."""

from __future__ import annotations

import contextlib
import socket

import pytest

from gateway.engine.spec import LoraSettings
from gateway.ops.metrics import Metrics
from gateway.pipeline.adapters import AdapterConfig
from gateway.upstream.adapters import AdapterSync
from gateway.upstream.client import SMALL_ANSWER_MAX_BYTES, AnswerTooLarge, UpstreamConfig, UpstreamFailure
from gateway.upstream.workers import Worker
from plugins.routing.adapter_loader import AdapterLoader
from tests.upstream.test_client_against_scripted_workers import Answer, client, raw_worker

BOUND = 64 << 10  # the smallest bound the config takes: small answers in the tests, quick to send


def answering(body: bytes, *, declared: bool) -> Answer:
    """A 200 carrying ``body``: with its Content-Length, or delimited by closing the connection (the
    length then known only once all of it was read)."""

    def answer(conn: socket.socket, head: bytes) -> bool:
        length = b"Content-Length: %d\r\n" % len(body) if declared else b"Connection: close\r\n"
        with contextlib.suppress(OSError):  # the client stopped reading and closed: what a bounded read does
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + length + b"\r\n" + body)
        return False

    return answer


def models_listing(size: int) -> bytes:
    """A valid /v1/models answer of ``size`` bytes (whitespace padding), listing the adapter ``sql``."""
    head, tail = b'{"data": [{"id": "sql", "parent": "base", "root": "/a/sql"}', b"]}"
    return head + b" " * (size - len(head) - len(tail)) + tail


def test_the_default_bound_fits_a_busy_workers_metrics_and_is_a_few_mib() -> None:
    assert UpstreamConfig().max_small_answer_bytes == SMALL_ANSWER_MAX_BYTES
    assert 1 << 20 <= SMALL_ANSWER_MAX_BYTES <= 16 << 20


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "close-delimited"])
async def test_a_get_answer_over_the_bound_fails_the_call(declared: bool) -> None:
    upstream = client(max_small_answer_bytes=BOUND)
    over = answering(b"x" * (4 * BOUND), declared=declared)
    try:
        with raw_worker(over) as worker, pytest.raises(AnswerTooLarge) as failed:
            await upstream.get(worker.url + "/metrics", 5)
    finally:
        await upstream.aclose()
    assert failed.value.error.status_code == 502 and failed.value.kind == "protocol"
    assert f"{BOUND:,} bytes" in failed.value.error.message


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "close-delimited"])
async def test_a_get_answer_of_exactly_the_bound_is_read_whole(declared: bool) -> None:
    upstream = client(max_small_answer_bytes=BOUND)
    try:
        with raw_worker(answering(b"x" * BOUND, declared=declared)) as worker:
            status, body = await upstream.get(worker.url + "/metrics", 5)
    finally:
        await upstream.aclose()
    assert status == 200 and len(body) == BOUND


async def test_a_model_listing_over_the_bound_is_a_failed_adapter_sync_that_keeps_what_was_known() -> None:
    upstream = client(max_small_answer_bytes=BOUND)
    try:
        with raw_worker(answering(models_listing(4 * BOUND), declared=False)) as worker:
            held = Worker(url=worker.url)
            held.adapters.added("support", 1.0, "/a/support")
            sync = AdapterSync(upstream.get, lambda: [held], interval_s=5, timeout_s=5)
            assert await sync.sync_one(held) is False  # as for a worker that cannot be read
    finally:
        await upstream.aclose()
    assert set(held.adapters.held) == {"support"}  # unknown is not empty: nothing dropped, nothing learnt


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "close-delimited"])
async def test_an_adapter_load_answered_over_the_bound_is_an_upstream_failure(declared: bool) -> None:
    """The request path counts an ``UpstreamFailure`` against the worker (as an unreachable one); the
    adapter is neither held nor loading afterwards."""
    upstream = client(max_small_answer_bytes=BOUND)
    loader = AdapterLoader(upstream, Metrics())
    target = None
    try:
        with raw_worker(answering(b"x" * (4 * BOUND), declared=declared)) as worker:
            target = Worker(url=worker.url)
            with pytest.raises(UpstreamFailure) as failed:
                await loader.ensure(target, AdapterConfig(name="sql", path="/a/sql"), LoraSettings())
    finally:
        await upstream.aclose()
    assert isinstance(failed.value, AnswerTooLarge)
    assert "sql" not in target.adapters.held and not target.adapters.loading
