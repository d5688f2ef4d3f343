"""Every plugin treats a LoRA adapter as a model: a key's allow-list names adapters (a key not allowed one
gets the 404 of an unknown model, and never sees it listed), and the cache keeps an adapter's answers apart
from the base model's. Real tenancy and cache plugins on the real Redis, a fake LoRA worker on loopback."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from tests.support.cache import namespace, redis_client, wait_stored
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.support.tenancy import prefix

__all__ = ["namespace", "prefix", "redis_client"]  # fixtures used by name below (each test's own Redis keys)

ADMIN = "adm-" + uuid.uuid4().hex
BODY = {"messages": [{"role": "user", "content": "write the query"}], "temperature": 0, "max_tokens": 4}


@pytest.fixture
def lora_worker() -> Iterator[tuple[FakeUpstream, ServerThread]]:
    fake = FakeUpstream(name="lora", lora=True)
    with ServerThread(fake) as server:
        yield fake, server


def config(url: str, tenancy_prefix: str, cache_namespace: str) -> dict[str, Any]:
    cfg = base_config(
        [url],
        plugins=[
            {"name": "tenancy", "config": {"redis_prefix": tenancy_prefix}},
            {"name": "cache", "config": {"namespace": cache_namespace, "timeout_ms": 500}},
            {"name": "routing"},
        ],
    )
    cfg["models"][0]["adapters"] = [{"name": "sql", "path": "/adapters/sql", "aliases": ["sql-v1"]}]
    return cfg


def create_key(server: ServerThread, key_id: str, models: list[str]) -> str:
    reply = httpx.post(
        server.url + "/admin/plugins/tenancy/create_key",
        json={"tenant": f"t-{key_id}", "id": key_id, "models": models},
        headers={"authorization": f"Bearer {ADMIN}"},
    )
    assert reply.status_code == 200, reply.text
    return str(reply.json()["result"]["key"])


def ask(server: ServerThread, key: str, model: str) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/chat/completions",
        json={**BODY, "model": model},
        headers={"authorization": f"Bearer {key}"},
        timeout=10,
    )


def listed(server: ServerThread, key: str) -> set[str]:
    reply = httpx.get(server.url + "/v1/models", headers={"authorization": f"Bearer {key}"})
    return {card["id"] for card in reply.json()["data"]}


def test_a_key_not_allowed_an_adapter_gets_404_and_never_sees_it(
    gateway_factory: GatewayFactory, lora_worker: tuple[FakeUpstream, ServerThread], prefix: str, namespace: str
) -> None:
    fake, worker = lora_worker
    with gateway_factory(config(worker.url, prefix, namespace), admin_token=ADMIN) as (_, gw):
        base_only, sql_only = create_key(gw, "base", ["m1"]), create_key(gw, "sql", ["sql"])
        for model in ("sql", "sql-v1"):
            refused = ask(gw, base_only, model)
            assert refused.status_code == 404
            assert refused.json()["error"]["code"] == "model_not_found"
        assert listed(gw, base_only) == {"m1", "alias-1"}
        assert fake.requests == [] and fake.lora_calls == []  # refused before any load or upstream call
        # allowed the adapter (by its name: its alias too), not the base model it was trained on
        assert ask(gw, sql_only, "sql-v1").status_code == 200
        assert ask(gw, sql_only, "m1").status_code == 404
        assert listed(gw, sql_only) == {"sql", "sql-v1"}
        assert [r.body["model"] for r in fake.requests] == ["sql"]


def test_the_cache_keeps_an_adapters_answers_apart_from_the_base_models(
    gateway_factory: GatewayFactory,
    lora_worker: tuple[FakeUpstream, ServerThread],
    prefix: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    fake, worker = lora_worker
    with gateway_factory(config(worker.url, prefix, namespace), admin_token=ADMIN) as (_, gw):
        key = create_key(gw, "all", ["*"])
        fake.behavior.text = "the base model's answer"
        assert ask(gw, key, "m1").headers["x-cache"] == "miss"
        wait_stored(redis_client, namespace, 1)
        fake.behavior.text = "the adapter's answer"
        first = ask(gw, key, "sql")
        assert first.headers["x-cache"] == "miss" and "adapter's" in first.text
        wait_stored(redis_client, namespace, 2)
        for model in ("sql", "sql-v1"):  # an alias shares its adapter's entries
            again = ask(gw, key, model)
            assert again.headers["x-cache"] == "hit" and "adapter's" in again.text
        assert "base model's" in ask(gw, key, "m1").text
    assert [r.body["model"] for r in fake.requests] == ["m1", "sql"]


def test_safety_rules_of_an_adapter_apply_to_it_and_not_to_its_base_model(
    gateway_factory: GatewayFactory, lora_worker: tuple[FakeUpstream, ServerThread]
) -> None:
    fake, worker = lora_worker
    cfg = base_config(
        [worker.url],
        plugins=[
            {
                "name": "safety",
                "config": {"models": {"sql": {"rules": [{"id": "no-drop", "kind": "words", "words": ["drop"]}]}}},
            },
            {"name": "routing"},
        ],
    )
    cfg["models"][0]["adapters"] = [{"name": "sql", "path": "/adapters/sql", "aliases": ["sql-v1"]}]
    body = {"messages": [{"role": "user", "content": "drop the table"}], "max_tokens": 4}
    with gateway_factory(cfg) as (_, gw):
        for model in ("sql", "sql-v1"):
            refused = httpx.post(gw.url + "/v1/chat/completions", json={**body, "model": model})
            assert refused.status_code == 400, refused.text
        assert httpx.post(gw.url + "/v1/chat/completions", json={**body, "model": "m1"}).status_code == 200
    assert [r.body["model"] for r in fake.requests] == ["m1"] and fake.lora_calls == []


def test_tokenize_for_an_adapter_uses_its_base_model_on_any_worker(
    gateway_factory: GatewayFactory, lora_worker: tuple[FakeUpstream, ServerThread]
) -> None:
    fake, worker = lora_worker
    cfg = base_config([worker.url])
    cfg["models"][0]["adapters"] = [{"name": "sql", "path": "/adapters/sql"}]
    with gateway_factory(cfg) as (_, gw):
        reply = httpx.post(gw.url + "/tokenize", json={"model": "sql", "prompt": "select 1"})
    assert reply.status_code == 200, reply.text
    assert [body["model"] for body in fake.tokenized] == ["m1"] and fake.lora_calls == []
