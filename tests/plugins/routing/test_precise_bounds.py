"""precise_prefix's per-request work is bounded by what a worker can take, not by what a client sends: a
prompt longer than the model's context, or than every worker's KV cache, is neither hashed nor placed by
its blocks (the worker refuses it; approximate affinity places it); long prompts waiting for the tokenizer
wait in its own thread, not in the loop's default thread pool."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.upstream.worker_load import LoadSample
from plugins.routing.config import ModelRouting
from plugins.routing.policies import WorkerPool
from plugins.routing.precise import PrecisePlacement
from plugins.routing.prompt_tokens import PromptTokenizer
from plugins.routing.telemetry import RoutingShared
from tests.support.gateways import REPO
from tests.support.safety import services

BLOCK = 4
URLS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


class Tokens(PromptTokenizer):
    """A tokenizer that gives ``n`` tokens for any prompt."""

    def __init__(self) -> None:
        super().__init__(None, None)
        self.n = 0

    def tokens(
        self, endpoint: str, body: dict[str, Any], *, wait: bool = True, at_most: int | None = None
    ) -> list[int]:
        return list(range(self.n))


def chat_body(text: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


def setup(**precise: Any) -> tuple[PrecisePlacement, WorkerPool, Tokens, Any]:
    svc = services()
    pool = WorkerPool([svc.workers.get(url) for url in URLS])
    routing = ModelRouting.model_validate({"policy": "precise_prefix", "precise": {"block_size": BLOCK, **precise}})
    tokens = Tokens()
    placement = PrecisePlacement("m", routing, tokens, svc.workers, RoutingShared(svc))
    return placement, pool, tokens, svc.workers


def ctx(max_model_len: int | None = None, body: dict[str, Any] | None = None) -> Any:
    endpoint = "completions" if body is None else "chat/completions"
    body = body or {"model": "m", "prompt": "x"}
    return SimpleNamespace(
        model=SimpleNamespace(name="m", max_model_len=max_model_len), body=body, raw_body=b"{}",
        endpoint=endpoint, request_id="r", tenant=None,
    )  # fmt: skip


async def test_a_prompt_longer_than_the_model_context_is_not_hashed() -> None:
    placement, pool, tokens, _ = setup()
    tokens.n = 64
    request = await placement.predict(ctx(max_model_len=64), pool)
    assert request is not None and len(request.hashes) == 16
    tokens.n = 65
    assert await placement.predict(ctx(max_model_len=64), pool) is None


async def test_a_prompt_longer_than_every_worker_kv_cache_is_not_hashed() -> None:
    placement, pool, tokens, workers = setup()
    now = time.monotonic()
    workers.load.record(URLS[0], LoadSample(0, 0, 0.0, now, cache_blocks=10, block_size=BLOCK))
    workers.load.record(URLS[1], LoadSample(0, 0, 0.0, now, cache_blocks=20, block_size=BLOCK))
    tokens.n = 80  # the larger cache holds 80 tokens
    assert await placement.predict(ctx(), pool) is not None
    tokens.n = 81
    assert await placement.predict(ctx(), pool) is None


async def test_without_a_known_context_or_cache_size_the_prompt_is_hashed() -> None:
    placement, pool, tokens, workers = setup()
    workers.load.record(URLS[0], LoadSample(0, 0, 0.0, time.monotonic(), cache_blocks=10, block_size=BLOCK))
    tokens.n = 400  # the other worker's cache size is not known: it may be larger
    request = await placement.predict(ctx(), pool)
    assert request is not None and len(request.hashes) == 100


class HeldTokenizer:
    """A Hugging Face-like tokenizer whose every encode waits until released (a long prompt)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        self.entered.set()
        self.release.wait(30)
        return [1] * 8


async def test_long_prompts_waiting_for_the_tokenizer_leave_the_default_thread_pool_free() -> None:
    """The tokenizer takes one prompt at a time. Long prompts waiting for it must not each hold a thread of
    the loop's default pool, which the gateway's file I/O, config reads and safety's token counts share."""
    placement, pool, _, _ = setup(tokenizer_wait_s=60)  # here they do wait, each for its turn
    held = HeldTokenizer()
    placement.tokenizer = PromptTokenizer(held, None)
    long_body = ctx()
    long_body.raw_body = b"x" * (placement.config.thread_above_chars + 1)  # tokenized in a thread
    waiting = [asyncio.create_task(placement.predict(long_body, pool)) for _ in range(40)]
    try:
        assert await asyncio.to_thread(held.entered.wait, 10)
        # bounded, never a timing check: without the fix this never runs until the tokenizer is released
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "ran"), 10) == "ran"
    finally:
        held.release.set()
        results = await asyncio.gather(*waiting)
    assert all(r is not None and r.prompt_tokens == 8 for r in results)


async def test_a_request_that_finds_the_tokenizer_busy_is_not_predicted_and_not_tokenized_later() -> None:
    """A long prompt holds the tokenizer: a short request gives up on it after ``tokenizer_wait_s`` (placed
    by approximate affinity) instead of waiting its turn, and its tokenization is never started."""
    placement, pool, _, _ = setup(tokenizer_wait_s=0)
    held = HeldTokenizer()
    placement.tokenizer = PromptTokenizer(held, None)
    long_body = ctx()
    long_body.raw_body = b"x" * (placement.config.thread_above_chars + 1)
    long = asyncio.create_task(placement.predict(long_body, pool))
    try:
        assert await asyncio.to_thread(held.entered.wait, 10)
        assert await asyncio.wait_for(placement.predict(ctx(), pool), 10) is None
        assert not long.done()
    finally:
        held.release.set()
    request = await long
    assert request is not None and request.prompt_tokens == 8
    assert held.calls == 1  # the short request's prompt was not tokenized after the long one either
    assert await placement.predict(ctx(), pool) is not None  # a free tokenizer: predicted again


MODEL_DIR = REPO / "models" / "smollm2"


class CountedEncodes:
    """The real Rust tokenizer, counting the prompts it tokenizes."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def encode_batch(self, texts: list[str], **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner.encode_batch(texts, **kwargs)


@pytest.mark.skipif(not MODEL_DIR.is_dir(), reason="the default model is not prepared (models/smollm2)")
async def test_a_prompt_whose_characters_prove_it_too_long_is_never_tokenized() -> None:
    """Each token of the model's byte-level tokenizer stands for at most its longest vocabulary entry's
    characters, so a chat whose text is longer than that times the model's context is refused a prediction
    without tokenizing it (seconds for a 4 MiB body); a text just as dense within the limit is tokenized."""
    placement, pool, _, _ = setup()
    placement.tokenizer = tokenizer = await PromptTokenizer.load(str(MODEL_DIR))
    model = tokenizer._tok
    model._tokenizer = counted = CountedEncodes(model._tokenizer)
    densest = "\n" + " " * (model.chars_per_token - 1)  # the vocabulary's longest entry
    tokens = tokenizer.tokens("chat/completions", chat_body(densest * 20))
    assert tokens is not None and counted.calls == 1
    limit = len(tokens)  # the context this very prompt just fits in: it must still be predicted
    request = await placement.predict(ctx(max_model_len=limit, body=chat_body(densest * 20)), pool)
    assert request is not None and request.prompt_tokens == limit and counted.calls == 2
    too_long = chat_body("word " * (limit * model.chars_per_token))  # 5 characters a token, far over the limit
    assert await placement.predict(ctx(max_model_len=limit, body=too_long), pool) is None
    assert counted.calls == 2
