"""Routes without inference are metered and bounded like chat (issue 30): ``/tokenize``, ``/detokenize``
and ``GET /v1/models`` (and ``/v1/models/{id}``) count against the key's request limits, share them
with chat, and tokenize gets chat's bounds on messages and prompt size. Tenancy on real Redis, safety
with the product's kind of limits, a fake worker on a real socket."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from plugins.tenancy.keys import hash_key
from tests.support.fakes import ServerThread, running
from tests.support.gateways import GatewayFactory, base_config
from tests.support.tenancy import PEPPER, prefix
from tests.support.vllm_extras_fake import ExtrasWorker

__all__ = ["prefix"]  # the fixture, used by name

LIMITED = "sk-side-limited-key"  # 5 requests a minute
OTHER = "sk-side-other-tenant"  # another tenant, no limits
ONLY_M2 = "sk-side-only-m2"
RPM = 5
LIMITS = {"max_messages": 8, "max_prompt_chars": 2000, "max_body_bytes": 1_000_000}


def config(prefix: str, url: str) -> dict[str, Any]:
    keys = [
        {
            "id": "limited",
            "tenant": "a",
            "hash": hash_key(LIMITED, PEPPER.encode()),
            "limits": {"requests_per_minute": RPM},
        },
        {"id": "other", "tenant": "b", "hash": hash_key(OTHER, PEPPER.encode())},
        {"id": "m2", "tenant": "c", "hash": hash_key(ONLY_M2, PEPPER.encode()), "models": ["m2"]},
    ]
    safety = {
        "limits": LIMITS,
        # m1 allows more messages (a caller who may not see m1 must still get the default bound) and
        # counts prompt tokens (only the detokenize test reaches that count).
        "models": {"m1": {"limits": {"max_messages": 64, "max_prompt_tokens": 4}, "tokenizer": "/nonexistent.json"}},
    }
    built = base_config(
        [url],
        plugins=[
            {"name": "tenancy", "config": {"redis_prefix": prefix, "keys": keys}},
            {"name": "safety", "config": safety},
            {"name": "routing"},
        ],
    )
    built["models"].append({"name": "m2", "workers": [url]})
    return built


@pytest.fixture
def worker() -> Iterator[tuple[ExtrasWorker, ServerThread]]:
    fake = ExtrasWorker(name="w")
    with running(fake) as server:
        yield fake, server


@pytest.fixture
def gateway(
    gateway_factory: GatewayFactory, worker: tuple[ExtrasWorker, ServerThread], prefix: str
) -> Iterator[ServerThread]:
    with gateway_factory(config(prefix, worker[1].url)) as (_, server):
        yield server


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def calls(server: ServerThread, key: str) -> dict[str, Callable[[], httpx.Response]]:
    def post(path: str, body: dict[str, Any]) -> Callable[[], httpx.Response]:
        return lambda: httpx.post(server.url + path, json=body, headers=auth(key), timeout=10)

    def get(path: str) -> Callable[[], httpx.Response]:
        return lambda: httpx.get(server.url + path, headers=auth(key), timeout=10)

    return {
        "tokenize": post("/tokenize", {"model": "m2", "prompt": "hello world"}),
        "detokenize": post("/detokenize", {"model": "m2", "tokens": [1, 2]}),
        "models": get("/v1/models"),
        "model": get("/v1/models/m2"),
        "chat": post("/v1/chat/completions", {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}),
        "unknown model": post("/tokenize", {"model": "no-such-model", "prompt": "hello"}),
    }


def worker_paths(worker: tuple[ExtrasWorker, ServerThread]) -> list[str]:
    return [seen.path for seen in worker[0].requests if seen.path != "/health"]


@pytest.mark.parametrize("route", ["tokenize", "detokenize", "models", "model", "unknown model"])
def test_each_side_route_counts_against_the_keys_request_limit(
    gateway: ServerThread, worker: tuple[ExtrasWorker, ServerThread], route: str
) -> None:
    call = calls(gateway, LIMITED)[route]
    answered = [call().status_code for _ in range(RPM)]
    assert 429 not in answered, answered
    refused = call()
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1
    before = len(worker_paths(worker))
    assert calls(gateway, LIMITED)["tokenize"]().status_code == 429
    assert len(worker_paths(worker)) == before  # a refused tokenize reaches no worker
    # Another tenant's key is not touched by this key's calls.
    assert calls(gateway, OTHER)[route]().status_code == answered[0]


def test_side_routes_and_chat_share_one_request_limit(gateway: ServerThread) -> None:
    mine = calls(gateway, LIMITED)
    for route in ("tokenize", "detokenize", "models", "model"):
        assert mine[route]().status_code == 200
    assert mine["chat"]().status_code == 200  # the fifth request of the minute
    assert mine["chat"]().status_code == 429
    assert mine["tokenize"]().status_code == 429
    assert mine["models"]().status_code == 429


def test_a_key_refused_on_chat_is_refused_on_tokenize(gateway: ServerThread) -> None:
    mine = calls(gateway, LIMITED)
    statuses = [mine["chat"]().status_code for _ in range(RPM + 1)]
    assert statuses[-1] == 429
    assert mine["tokenize"]().status_code == 429


def test_tokenize_without_a_key_is_refused_before_any_bound(gateway: ServerThread) -> None:
    body = {"model": "m1", "messages": [{"role": "user", "content": "x"}] * 20_000}
    response = httpx.post(gateway.url + "/tokenize", json=body, timeout=30)
    assert response.status_code == 401


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}] * 20_000}, "messages"),
        ({"messages": [{"role": "user", "content": "x" * 5000}]}, "messages"),
        ({"prompt": "word " * 1000}, "prompt"),
    ],
    ids=["20000 messages", "long message", "long prompt"],
)
def test_tokenize_gets_chats_size_and_count_bounds(
    gateway: ServerThread, worker: tuple[ExtrasWorker, ServerThread], body: dict[str, Any], param: str
) -> None:
    response = httpx.post(gateway.url + "/tokenize", json={"model": "m2", **body}, headers=auth(OTHER), timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("limit_exceeded", param)
    assert worker_paths(worker) == []


def test_a_body_over_the_byte_bound_is_refused(
    gateway: ServerThread, worker: tuple[ExtrasWorker, ServerThread]
) -> None:
    body = {"model": "m2", "prompt": "x" * 1_100_000}
    response = httpx.post(gateway.url + "/tokenize", json=body, headers=auth(OTHER), timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "request_too_large"
    assert worker_paths(worker) == []


def test_detokenize_token_count_is_bounded_by_the_models_prompt_tokens(
    gateway: ServerThread, worker: tuple[ExtrasWorker, ServerThread]
) -> None:
    body = {"model": "m1", "tokens": [1] * 5}
    response = httpx.post(gateway.url + "/detokenize", json=body, headers=auth(OTHER), timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tokens"
    assert worker_paths(worker) == []


def test_a_hidden_model_is_bounded_like_an_unknown_one(gateway: ServerThread) -> None:
    """m1 allows 64 messages, the default 8: a key that may not use m1 gets the default, as for a name
    that does not exist, so the bound tells it nothing about m1."""
    body = {"messages": [{"role": "user", "content": ""}] * 20}  # no text: m1's token count never runs
    allowed = httpx.post(gateway.url + "/tokenize", json={"model": "m1", **body}, headers=auth(OTHER), timeout=10)
    assert allowed.status_code == 200, allowed.text
    answers = [
        httpx.post(gateway.url + "/tokenize", json={"model": name, **body}, headers=auth(ONLY_M2), timeout=10)
        for name in ("m1", "no-such-model")
    ]
    assert [a.status_code for a in answers] == [400, 400]
    assert answers[0].json() == answers[1].json()
