"""Cache hits of real vLLM answers, through the openai SDK and real Redis: each hit is a new completion
(fresh id and created) with everything else the original had, and a replayed stream is chunked like the
stream vLLM sent (not 3-4 merged chunks)."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from plugins.cache import CachePlugin
from tests.support.cache import namespace, redis_client, sdk, wait_stored
from tests.support.gateways import GatewayFactory

__all__ = ["namespace", "redis_client"]  # fixtures used by name below

pytestmark = pytest.mark.engine

ASK = [{"role": "user", "content": "Name three colours, separated by commas."}]


def _config(worker_url: str, namespace: str) -> dict[str, Any]:
    return {
        "models": [{"name": "smollm2", "workers": [worker_url], "max_model_len": 2048}],
        "plugins": [
            {"name": "cache", "config": {"namespace": namespace, "timeout_ms": 200}},
            {"name": "routing"},
        ],
        "upstream": {"first_byte_timeout_s": 300, "idle_timeout_s": 120},
    }


def _without(obj: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in keys}


def test_hits_of_a_real_answer_streamed_and_not(
    gateway_factory: GatewayFactory, real_worker: Any, namespace: str, redis_client: redis.Redis
) -> None:
    params: dict[str, Any] = {"model": "smollm2", "messages": ASK, "max_tokens": 24, "temperature": 0}
    usage = {"stream_options": {"include_usage": True}}
    with gateway_factory(_config(real_worker.url, namespace), plugins={"cache": CachePlugin}) as (_, server):
        client = sdk(server.url).with_options(timeout=300)
        raw = client.chat.completions.with_raw_response.create(stream=True, **params, **usage)
        assert raw.headers["x-cache"] == "miss"
        original = list(raw.parse())
        wait_stored(redis_client, namespace)
        replays = []
        for _ in range(2):
            raw = client.chat.completions.with_raw_response.create(stream=True, **params, **usage)
            assert raw.headers["x-cache"] == "hit" and int(raw.headers["age"]) >= 0
            replays.append(list(raw.parse()))
        hit = client.chat.completions.with_raw_response.create(**params)
        assert hit.headers["x-cache"] == "hit"
        answer = hit.parse()
    assert len(original) > 5  # vLLM streams about a token per event
    ids = {original[0].id}
    for chunks in replays:
        assert len(chunks) == len(original)
        for replayed, first in zip(chunks, original, strict=True):
            assert _without(replayed.model_dump(), "id", "created") == _without(first.model_dump(), "id", "created")
        assert len({c.id for c in chunks}) == 1 and chunks[0].id not in ids
        ids.add(chunks[0].id)
    text = "".join(c.choices[0].delta.content or "" for c in original if c.choices)
    assert answer.choices[0].message.content == text
    assert answer.id.startswith("chatcmpl-") and answer.id not in ids
    assert answer.system_fingerprint == original[0].system_fingerprint
    assert answer.usage == original[-1].usage


def test_a_real_stream_is_stored_for_a_client_that_did_not_ask_for_its_usage(
    gateway_factory: GatewayFactory, real_worker: Any, namespace: str, redis_client: redis.Redis
) -> None:
    """The stream passes through as vLLM's bytes while the cache records it: the usage event the cache
    asked vLLM for reaches neither this client nor a replay for it, yet the stored answer carries it."""
    ask = [{"role": "user", "content": "Name two animals."}]
    params: dict[str, Any] = {"model": "smollm2", "messages": ask, "max_tokens": 16, "temperature": 0}
    with gateway_factory(_config(real_worker.url, namespace), plugins={"cache": CachePlugin}) as (_, server):
        client = sdk(server.url).with_options(timeout=300)
        raw = client.chat.completions.with_raw_response.create(stream=True, **params)
        assert raw.headers["x-cache"] == "miss"
        original = list(raw.parse())
        wait_stored(redis_client, namespace)
        raw = client.chat.completions.with_raw_response.create(stream=True, **params)
        assert raw.headers["x-cache"] == "hit"
        replayed = list(raw.parse())
        hit = client.chat.completions.with_raw_response.create(**params)
        assert hit.headers["x-cache"] == "hit"
        answer = hit.parse()
    text = "".join(c.choices[0].delta.content or "" for c in original if c.choices)
    assert text and all(c.choices and c.usage is None for c in original + replayed)
    assert "".join(c.choices[0].delta.content or "" for c in replayed) == text
    assert answer.choices[0].message.content == text
    usage = answer.usage
    assert usage is not None and usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
