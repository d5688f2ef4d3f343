"""Each tenant's prompts share a worker's prefix cache with that tenant's prompts only.

The real tenancy plugin in front of the fake worker, over HTTP: every request that reaches a worker on a
route vLLM salts carries a ``cache_salt`` bound to its tenant. Keys of one tenant get the same salt, on
any replica; another tenant's differs. A client's own salt is folded into its tenant's, so no client can
send another tenant's salt; a salt vLLM would refuse goes on as sent, for the worker's 400. With
``prefix_cache: shared`` bodies go on as the client sent them. While the body is otherwise unchanged, the
salt goes in front of the client's bytes and the rest of them are forwarded as they came. Whether vLLM
then keeps the tenants' prefixes apart is tests/e2e/test_tenancy_with_vllm.py's part.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from plugins.tenancy.keys import hash_key
from plugins.tenancy.prefix_salt import salt_of
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.support.tenancy import PEPPER, prefix

__all__ = ["prefix"]  # the fixture, used by name

KEYS = {"a1": ("acme", "sk-gw-salt-acme-1"), "a2": ("acme", "sk-gw-salt-acme-2"), "g1": ("globex", "sk-gw-salt-g1")}
CHAT = {"model": "m1", "messages": [{"role": "user", "content": "The plan for the merger is"}], "max_tokens": 4}


def config(upstream_url: str, prefix: str, **section: Any) -> dict[str, Any]:
    keys = [
        {"id": key_id, "tenant": tenant, "hash": hash_key(key, PEPPER.encode())}
        for key_id, (tenant, key) in KEYS.items()
    ]
    tenancy = {"name": "tenancy", "config": {"redis_prefix": prefix, "keys": keys, **section}}
    return base_config([upstream_url], plugins=[tenancy, {"name": "routing"}])


@contextlib.contextmanager
def gateway_of(factory: GatewayFactory, upstream_url: str, prefix: str, **section: Any) -> Iterator[ServerThread]:
    with factory(config(upstream_url, prefix, **section)) as (_, server):
        yield server


@pytest.fixture
def gateway(gateway_factory: GatewayFactory, upstream_url: str, prefix: str) -> Iterator[ServerThread]:
    with gateway_of(gateway_factory, upstream_url, prefix) as server:
        yield server


def send(server: ServerThread, key_id: str, content: bytes, path: str = "/v1/chat/completions") -> httpx.Response:
    headers = {"authorization": f"Bearer {KEYS[key_id][1]}", "content-type": "application/json"}
    reply = httpx.post(server.url + path, content=content, headers=headers, timeout=10)
    assert reply.status_code == 200, reply.text
    return reply


def salt_seen(
    upstream: FakeUpstream, server: ServerThread, key_id: str, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> Any:
    """The cache_salt the worker got for ``body`` sent with ``key_id``'s key (``...`` when it got none)."""
    send(server, key_id, orjson.dumps(body), path)
    return upstream.requests[-1].body.get("cache_salt", ...)


def test_each_tenant_has_one_salt_for_all_its_keys_on_every_replica(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, gateway: ServerThread, prefix: str
) -> None:
    acme, globex = salt_of("acme"), salt_of("globex")
    assert acme != globex and len(acme) == 32
    assert [salt_seen(upstream, gateway, key_id, CHAT) for key_id in KEYS] == [acme, acme, globex]
    embed = {"model": "m1", "input": "The plan for the merger is"}
    assert [salt_seen(upstream, gateway, key_id, embed, "/v1/embeddings") for key_id in KEYS] == [acme, acme, globex]
    completion = {"model": "m1", "prompt": "The plan for the merger is", "max_tokens": 4}
    assert salt_seen(upstream, gateway, "g1", completion, "/v1/completions") == globex
    # another replica (a gateway of its own, with nothing shared but the config) salts the same
    with gateway_of(gateway_factory, upstream_url, prefix) as replica:
        assert [salt_seen(upstream, replica, key_id, CHAT) for key_id in KEYS] == [acme, acme, globex]


def test_the_clients_bytes_go_on_as_sent_behind_the_salt(upstream: FakeUpstream, gateway: ServerThread) -> None:
    # spacing, key order and escapes a re-serialization would change
    sent = b'  {"messages": [{"role": "user", "content": "caf\\u00e9 \\/ plan"}],   "model":"m1", "max_tokens": 4 }'
    send(gateway, "a1", sent)
    assert upstream.requests[-1].raw == b'{"cache_salt":"' + salt_of("acme").encode() + b'",' + sent.lstrip()[1:]
    # a stream billed from its usage: both members go in front, and the client still does not see the usage
    stream = b'{"model":"m1","stream":true,"messages":[{"role":"user","content":"hi"}],"max_tokens":4}'
    reply = send(gateway, "g1", stream)
    seen = upstream.requests[-1]
    assert seen.raw.endswith(stream[1:]) and seen.body["cache_salt"] == salt_of("globex")
    assert seen.body["stream_options"] == {"include_usage": True}
    assert '"usage"' not in reply.text


def test_a_clients_own_salt_narrows_sharing_inside_its_tenant_only(
    upstream: FakeUpstream, gateway: ServerThread
) -> None:
    mine = salt_seen(upstream, gateway, "a1", {**CHAT, "cache_salt": "project-x"})
    assert (
        mine == salt_of("acme", "project-x") == salt_seen(upstream, gateway, "a2", {**CHAT, "cache_salt": "project-x"})
    )
    theirs = salt_seen(upstream, gateway, "g1", {**CHAT, "cache_salt": "project-x"})
    assert theirs == salt_of("globex", "project-x")
    other = salt_seen(upstream, gateway, "a1", {**CHAT, "cache_salt": "project-y"})
    # an attacker who learned globex's salt (or the one globex's clients get with theirs) cannot send it
    stolen = [salt_seen(upstream, gateway, "a1", {**CHAT, "cache_salt": salt}) for salt in (salt_of("globex"), theirs)]
    assert stolen == [salt_of("acme", salt_of("globex")), salt_of("acme", theirs)]
    salts = {mine, theirs, other, *stolen, salt_of("acme"), salt_of("globex")}
    assert len(salts) == 7
    # null is no salt to vLLM: the tenant's own then
    assert salt_seen(upstream, gateway, "g1", {**CHAT, "cache_salt": None}) == salt_of("globex")


@pytest.mark.parametrize("refused", ["", "a@b", "a/b", "a\\b", "a\x00b", "x" * 129, 7, ["x"], {"x": 1}])
def test_a_salt_vllm_refuses_goes_on_as_sent_for_its_400(
    upstream: FakeUpstream, gateway: ServerThread, refused: Any
) -> None:
    assert salt_seen(upstream, gateway, "a1", {**CHAT, "cache_salt": refused}) == refused


def test_the_longest_salt_vllm_takes_is_folded_in(upstream: FakeUpstream, gateway: ServerThread) -> None:
    longest = "s" * 128
    assert salt_seen(upstream, gateway, "a1", {**CHAT, "cache_salt": longest}) == salt_of("acme", longest)


def test_translated_routes_carry_the_salt(upstream: FakeUpstream, gateway: ServerThread) -> None:
    message = {"model": "m1", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    assert salt_seen(upstream, gateway, "g1", message, "/v1/messages") == salt_of("globex")
    assert upstream.requests[-1].path == "/v1/chat/completions"


def test_routes_vllm_does_not_salt_get_no_salt(upstream: FakeUpstream, gateway: ServerThread) -> None:
    send(gateway, "a1", orjson.dumps({"model": "m1", "prompt": "hi"}), "/tokenize")
    assert upstream.tokenized and "cache_salt" not in upstream.tokenized[-1]


def test_a_shared_prefix_cache_leaves_bodies_as_sent(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    sent = orjson.dumps(CHAT)
    with gateway_of(gateway_factory, upstream_url, prefix, prefix_cache="shared") as server:
        for key_id in KEYS:
            send(server, key_id, sent)
            assert upstream.requests[-1].raw == sent
        assert salt_seen(upstream, server, "a1", {**CHAT, "cache_salt": "project-x"}) == "project-x"
