"""With two real vLLM CPU workers publishing KV cache events: the gateway's index agrees with the workers.

Each worker has a small KV cache (12 blocks of 128 tokens, float32), so the workload (ten system
prompts of three full blocks each, two questions per prompt back to back, then one more per prompt) does
not fit and the workers evict whatever the placement (30 blocks of prefixes, 24 blocks in both caches
together): the index must follow ``BlockRemoved`` as well as ``BlockStored``. For every request the
access log carries the gateway's prediction (``cached_tokens_predicted``) beside the worker's usage
(``prompt_tokens_details.cached_tokens``); they must be equal on at least 95% of requests. Then one
worker is killed and restarted by the engine supervisor: its entries are dropped, and the same
prompts are predicted as exactly again.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.ops.settings import Settings
from gateway.pipeline.config import GatewayConfig
from gateway.pipeline.registry import PluginRegistry
from gateway.server.app import GatewayApp, create_app
from tests.support.fakes import ServerThread, free_port
from tests.support.gateways import REPO, engine_config
from tests.support.processes import kill_worker

pytestmark = pytest.mark.engine

BLOCK = 128
CACHE_BLOCKS = 12
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # K and V x layers x KV heads x head dim x float32 (config.json)


class Predictions(logging.Handler):
    """(predicted, reported) cached tokens of every request, from the access log."""

    def __init__(self) -> None:
        super().__init__()
        self.pairs: list[tuple[int, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "fields", None)
        if not isinstance(fields, dict) or "cached_tokens_predicted" not in fields:
            return
        details = (fields.get("usage") or {}).get("prompt_tokens_details") or {}
        self.pairs.append((fields["cached_tokens_predicted"], details.get("cached_tokens", -1)))


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[GatewayApp, ServerThread, list[str]]]:
    if not (REPO / "models" / "smollm2").is_dir():
        pytest.skip("the default model is not prepared (models/smollm2)")
    ports = [free_port(), free_port()]
    config = engine_config(ports[0])
    spec = config["engine"]["workers"][0]
    cores = __import__("os").cpu_count() or 1
    config["engine"]["workers"] = [
        {**spec, "name": f"kv-{i}", "port": p, "omp_threads_bind": str(i % cores), "dtype": "float32",
         "kv_events": True, "max_model_len": 1024, "max_num_seqs": 4,
         # VLLM_CPU_KVCACHE_SPACE (whole GiB) would override the bytes below (vllm/platforms/cpu.py)
         "kv_cache_space_gb": None,
         "extra_args": ["--kv-cache-memory-bytes", str(CACHE_BLOCKS * BLOCK * KV_BYTES_PER_TOKEN)]}
        for i, p in enumerate(ports)
    ]  # fmt: skip
    config["models"][0].update(workers=["kv-0", "kv-1"], max_model_len=1024)
    config["plugins"] = [{"name": "routing", "config": {"default": {"policy": "precise_prefix"}}}]
    app = create_app(Settings(model_dir=REPO / "models"), registry=PluginRegistry(),
                     config=GatewayConfig.model_validate(config))  # fmt: skip
    with ServerThread(app, start_timeout_s=900) as server:
        yield app, server, [f"http://127.0.0.1:{p}" for p in ports]


def workload(prompts: int, questions: int, revisit: bool = False) -> list[dict[str, Any]]:
    """Each prompt's questions back to back (the later ones reuse its cached prefix whatever the
    placement); with ``revisit``, one more question per prompt after all of them, in the same order: by
    then the small caches have evicted the early prompts, so only an index that followed the
    evictions predicts those revisits right."""
    nonce = uuid.uuid4().hex[:8]
    rng = random.Random(5)
    words = ["parcel", "courier", "refund", "customs", "label", "warehouse", "tracking", "address", "invoice", "pallet"]
    systems = [f"[{nonce}-{k}] Policy {k}: " + " ".join(rng.choices(words, k=330)) for k in range(prompts)]
    order = [(k, q) for k in range(prompts) for q in range(questions)]
    order += [(k, questions) for k in range(prompts)] if revisit else []
    return [
        {"model": "smollm2", "max_tokens": 2, "temperature": 0,
         "messages": [{"role": "system", "content": systems[k]}, {"role": "user", "content": f"Question {q}?"}]}
        for k, q in order
    ]  # fmt: skip


def send_all(app: GatewayApp, server: ServerThread, bodies: list[dict[str, Any]]) -> None:
    feed = app.state.services.workers.kv
    with httpx.Client(base_url=server.url, timeout=300) as http:
        for body in bodies:
            before = {url: state.batches for url, state in feed.workers.items()}
            reply = http.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            # The events of this request's prefill reach the index after the engine step; give them a moment
            # (bounded; no assertion on it) so the next request is predicted from them.
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and all(s.batches == before.get(u) for u, s in feed.workers.items()):
                time.sleep(0.02)
            time.sleep(0.05)


def agreement(pairs: list[tuple[int, int]]) -> float:
    return sum(p == r for p, r in pairs) / len(pairs)


@pytest.mark.timeout(2700)  # two worker starts (a restart included) on a shared, loaded CPU
def test_the_index_agrees_with_the_workers_through_evictions_and_a_restart(
    gateway: tuple[GatewayApp, ServerThread, list[str]],
) -> None:
    app, server, urls = gateway
    recorder = Predictions()
    logging.getLogger("gateway.access").addHandler(recorder)
    try:
        send_all(app, server, workload(prompts=10, questions=2, revisit=True))
        pairs = list(recorder.pairs)
        feed = app.state.services.workers.kv
        # The block size is learned from the first events: the very first requests may go unpredicted.
        assert len(pairs) >= 16
        assert agreement(pairs) >= 0.95, pairs
        assert sum(r for _, r in pairs) > 0  # prefixes were reused, not only predicted as misses
        assert sum(feed.workers[u].removals for u in urls) > 0  # the small caches evicted, and we followed

        restarted = urls[0]
        kill_worker(restarted)
        worker = app.state.services.workers.get(restarted)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and worker.healthy:  # the health check notices the death
            time.sleep(0.5)
        assert feed.index.blocks(restarted) == 0  # the dead process's blocks were dropped
        while time.monotonic() < deadline and not worker.healthy:  # the supervisor starts it again
            time.sleep(1)
        assert worker.healthy
        recorder.pairs.clear()
        send_all(app, server, workload(prompts=4, questions=2))
        after = list(recorder.pairs)
        assert len(after) == 8  # the block size is known now: every request is predicted
        assert agreement(after) >= 0.95, after
    finally:
        logging.getLogger("gateway.access").removeHandler(recorder)
