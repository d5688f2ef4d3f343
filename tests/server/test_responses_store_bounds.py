"""What one tenant can make the Responses store keep, against the fake worker
and the real Redis: empty parts are counted, a record and a tenant have byte bounds (413, 429) checked
before any worker is asked, a chain stores each turn once (turn N never rewrites turns 1..N-1) and is
bounded, the stored bytes are visible per tenant on the admin API, stored-response reads are metered
by the key's request limits, and what is stored is what the worker saw (safety's redactions applied)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis

from plugins.tenancy.keys import hash_key
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config

PEPPER = "pepper-" + uuid.uuid4().hex
KEYS = {
    "acme-1": ("acme", "sk-acme-1-" + uuid.uuid4().hex),
    "globex-1": ("globex", "sk-globex-1-" + uuid.uuid4().hex),
}


@pytest.fixture
def names(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    monkeypatch.setenv("GATEWAY_TENANCY_PEPPER", PEPPER)
    tag = uuid.uuid4().hex[:12]
    found = {"responses": f"test:respb:{tag}", "tenancy": f"test:respbtn:{tag}"}
    yield found
    client = redis.Redis()
    for pattern in (f"{found['responses']}*", f"{found['tenancy']}*"):
        keys = list(client.scan_iter(match=pattern, count=1000))
        if keys:
            client.delete(*keys)
    client.close()


def tenancy(prefix: str, key_limits: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    keys = [
        {"id": kid, "tenant": tenant, "hash": hash_key(key, PEPPER.encode()), "limits": key_limits or {}}
        for kid, (tenant, key) in KEYS.items()
    ]
    return {"name": "tenancy", "config": {"redis_prefix": prefix, "keys": keys, **extra}}


def sdk(server: ServerThread, kid: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[kid][1] if kid else "unused", max_retries=0)


def chats(upstream: FakeUpstream) -> int:
    return sum(1 for r in upstream.requests if r.path == "/v1/chat/completions")


def records(prefix: str) -> dict[str, int]:
    client = redis.Redis()
    return {k.decode(): client.strlen(k) for k in client.scan_iter(match=f"{prefix}:*resp_*")}


EMPTY_PARTS = [{"role": "user", "content": [{"type": "input_text", "text": ""}] * 25000}]


def test_empty_parts_are_counted_and_the_record_is_bounded(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, names: dict[str, str]
) -> None:
    """The issue's attack (25,000 empty parts, max_output_tokens 1) is a 413 before any worker is asked;
    under a tokens-per-minute limit it is a 429 (each part costs at least a character of the prompt)."""
    config = base_config([upstream_url], responses={"redis_prefix": names["responses"]})
    with gateway_factory(config) as (_, server):
        reply = httpx.post(
            server.url + "/v1/responses",
            json={"model": "m1", "input": EMPTY_PARTS, "max_output_tokens": 1},
            timeout=30,
        )
        assert reply.status_code == 413, reply.text
        assert reply.json()["error"]["code"] == "response_too_large"
        assert chats(upstream) == 0 and records(names["responses"]) == {}
        # blank parts reach the worker as lines of the prompt, so limits and charges that read it see them
        sdk(server).responses.create(
            model="m1", input=[{"role": "user", "content": [{"type": "input_text", "text": " "}] * 3}], store=False
        )
        assert upstream.requests[-1].body["messages"][-1]["content"] == " \n \n "

    plugins = [tenancy(names["tenancy"], tenants={"acme": {"tokens_per_minute": 2000}}), {"name": "routing"}]
    config = base_config([upstream_url], plugins=plugins, responses={"redis_prefix": names["responses"]})
    with gateway_factory(config) as (_, server), pytest.raises(openai.RateLimitError) as caught:
        sdk(server, "acme-1").responses.create(model="m1", input=EMPTY_PARTS, max_output_tokens=1, store=False)  # type: ignore[arg-type]
    assert "tokens per min" in caught.value.message and chats(upstream) == 1


def test_a_chain_stores_each_turn_once_and_lists_the_whole_conversation(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, names: dict[str, str]
) -> None:
    config = base_config([upstream_url], responses={"redis_prefix": names["responses"]})
    with gateway_factory(config) as (_, server):
        client = sdk(server)
        previous = None
        text = "x" * 2000
        for turn in range(10):
            previous = client.responses.create(
                model="m1", input=f"{turn}: {text}", previous_response_id=previous.id if previous else None
            )
        assert previous is not None
        sizes = records(names["responses"])
        assert len(sizes) == 10
        assert max(sizes.values()) < 1.5 * min(sizes.values()), sizes  # turn 10 holds its own turn only
        # the worker still got the whole conversation, and input_items still lists it
        assert len(upstream.requests[-1].body["messages"]) == 19
        listed = client.responses.input_items.list(previous.id, order="asc", limit=100).data
        assert [item.role for item in listed] == ["user", "assistant"] * 9 + ["user"]  # type: ignore[union-attr]
        assert listed[0].content[0].text.startswith("0: ")  # type: ignore[union-attr]


def test_chain_bounds_refuse_the_turn_and_never_drop_history(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, names: dict[str, str]
) -> None:
    config = base_config([upstream_url], responses={"redis_prefix": names["responses"], "max_conversation_turns": 3})
    with gateway_factory(config) as (_, server):
        client = sdk(server)
        first = client.responses.create(model="m1", input="one")
        second = client.responses.create(model="m1", input="two", previous_response_id=first.id)
        third = client.responses.create(model="m1", input="three", previous_response_id=second.id)
        before = chats(upstream)
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="m1", input="four", previous_response_id=third.id)
        assert caught.value.code == "conversation_too_long" and chats(upstream) == before
        # a deleted earlier turn: continuing the chain is refused, naming it, rather than skipping it
        client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.create(model="m1", input="again", previous_response_id=second.id)
        assert first.id in missing.value.message and chats(upstream) == before


def test_an_answer_that_takes_the_chain_past_its_bytes_is_not_stored(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, names: dict[str, str]
) -> None:
    """max_conversation_bytes holds for what the turn stores, its output included, not only its input:
    an answer that takes the chain past the bound is refused when stored (plain and streamed)."""
    responses = {"redis_prefix": names["responses"], "max_conversation_bytes": 8000}
    config = base_config([upstream_url], responses=responses)
    with gateway_factory(config) as (_, server):
        client = sdk(server)
        first = client.responses.create(model="m1", input="one")
        upstream.behavior.text = "z" * 9000  # the input fits the bound; the answer does not
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="m1", input="two", previous_response_id=first.id)
        assert caught.value.code == "conversation_too_long"
        with pytest.raises(openai.APIError) as streamed:
            list(client.responses.create(model="m1", input="two", previous_response_id=first.id, stream=True))
        assert "conversation" in streamed.value.message
        assert [first.id in key for key in records(names["responses"])] == [True]  # nothing else was stored
        # a turn without previous_response_id is bounded by max_response_bytes only
        assert client.responses.create(model="m1", input="fresh").output_text == "z" * 9000


def test_a_tenant_over_its_stored_bytes_is_refused_and_others_are_not(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, names: dict[str, str]
) -> None:
    plugins = [tenancy(names["tenancy"]), {"name": "routing"}]
    responses = {"redis_prefix": names["responses"], "max_tenant_bytes": 12_000}
    config = base_config([upstream_url], plugins=plugins, responses=responses)
    with gateway_factory(config, admin_token="adm") as (_, server):
        acme, globex = sdk(server, "acme-1"), sdk(server, "globex-1")
        kept = []
        with pytest.raises(openai.RateLimitError) as caught:
            for _ in range(20):
                kept.append(acme.responses.create(model="m1", input="y" * 2500))
        assert caught.value.code == "stored_bytes_exceeded" and 2 <= len(kept) < 6
        before = chats(upstream)
        with pytest.raises(openai.RateLimitError):
            acme.responses.create(model="m1", input="y" * 2500)
        assert chats(upstream) == before  # refused before any worker was asked
        assert acme.responses.create(model="m1", input="not kept", store=False).output_text  # store: false works
        globex.responses.create(model="m1", input="y" * 2500)  # another tenant is not affected

        usage = httpx.get(server.url + "/admin/responses/usage", headers={"x-admin-token": "adm"}).json()
        by_tenant = {row["tenant"]: row for row in usage["tenants"]}
        assert by_tenant["acme"]["responses"] == len(kept) and by_tenant["globex"]["responses"] == 1
        stored = records(names["responses"])
        assert by_tenant["acme"]["bytes"] == sum(n for k, n in stored.items() if ":t:acme:" in k) <= 12_000
        assert httpx.get(server.url + "/admin/responses/usage").status_code == 401

        acme.responses.delete(kept[0].id)  # deleting frees room
        acme.responses.create(model="m1", input="y" * 2500)


def test_a_shorter_ttl_never_lets_the_count_expire_before_what_it_counts(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, names: dict[str, str]
) -> None:
    """After responses.ttl_s is lowered, a turn stored with the new TTL must not shorten the life of the
    tenant's byte count below that of the responses stored before: else the count expires first and the
    tenant may store max_tenant_bytes again on top of what Redis still holds."""
    for ttl_s in (3600, 60):
        config = base_config([upstream_url], responses={"redis_prefix": names["responses"], "ttl_s": ttl_s})
        with gateway_factory(config) as (_, server):
            sdk(server).responses.create(model="m1", input="y" * 2500)
    client = redis.Redis()
    longest = max(client.pttl(key) for key in records(names["responses"]))
    ledger = list(client.scan_iter(match=f"{names['responses']}:*:@*"))
    assert len(ledger) == 2 and longest > 3_000_000
    assert all(client.pttl(key) >= longest - 5000 for key in ledger)  # read a moment later


def test_reading_stored_responses_is_metered_by_the_keys_request_limit(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, names: dict[str, str]
) -> None:
    plugins = [tenancy(names["tenancy"], key_limits={"requests_per_minute": 4}), {"name": "routing"}]
    config = base_config([upstream_url], plugins=plugins, responses={"redis_prefix": names["responses"]})
    with gateway_factory(config) as (_, server):
        acme, globex = sdk(server, "acme-1"), sdk(server, "globex-1")
        made = acme.responses.create(model="m1", input="hello")  # 1 of 4
        acme.responses.retrieve(made.id)  # 2
        acme.responses.input_items.list(made.id)  # 3
        acme.responses.retrieve(made.id)  # 4
        for call in (
            lambda: acme.responses.retrieve(made.id),
            lambda: acme.responses.input_items.list(made.id),
            lambda: acme.responses.delete(made.id),
            lambda: acme.responses.create(model="m1", input="more"),
        ):
            with pytest.raises(openai.RateLimitError) as caught:
                call()
            assert caught.value.code == "rate_limit_exceeded" and "requests per min" in caught.value.message
        with pytest.raises(openai.NotFoundError):  # globex's own limit: metered, and scoped
            globex.responses.retrieve(made.id)
        assert redis.Redis().exists(*records(names["responses"])) == 1  # the refused delete deleted nothing


def test_the_store_keeps_what_the_worker_saw(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, names: dict[str, str]
) -> None:
    rules = [{"id": "secrets", "kind": "secrets", "action": "redact"}]
    plugins = [{"name": "safety", "config": {"rules": rules}}, {"name": "routing"}]
    config = base_config([upstream_url], plugins=plugins, responses={"redis_prefix": names["responses"]})
    secret = "AKIAIOSFODNN7EXAMPLE"
    with gateway_factory(config) as (_, server):
        client = sdk(server)
        made = client.responses.create(
            model="m1",
            instructions=f"The key is {secret}.",
            input=[
                {"role": "user", "content": [{"type": "input_text", "text": f"use {secret}"}]},
                {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": f'{{"k": "{secret}"}}'},
                {"type": "function_call_output", "call_id": "c1", "output": f"found {secret}"},
            ],
        )
        assert secret not in str(upstream.requests[-1].body)
        listed = client.responses.input_items.list(made.id, order="asc").data
        shown = str([item.model_dump() for item in listed]) + str(client.responses.retrieve(made.id).model_dump())
        assert secret not in shown and shown.count("[SECRET]") >= 4, shown
        assert secret not in str(records(names["responses"])) and all(
            secret.encode() not in (redis.Redis().get(k) or b"") for k in records(names["responses"])
        )
        assert [item.type for item in listed] == ["message", "function_call", "function_call_output"]
