"""vLLM's model-addressed routes (rerank, score, classify, pooling) through the gateway: routed by the body's
model to the workers that serve it, aliases resolved, behind tenancy (keys, allowed models, request limits),
the allow-list, the media URL check and the body limit, with OpenAI's error shape; a model none of whose
workers serves a route is a 404 that says so. Safety reads their texts, as on embeddings."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import redis

from plugins.tenancy.keys import hash_key
from plugins.tenancy.prefix_salt import salt_of
from tests.support.fakes import ServerThread
from tests.support.gateways import GatewayFactory

PEPPER = "pepper-" + uuid.uuid4().hex
KEYS = {
    "all": "sk-all-" + uuid.uuid4().hex,
    "chat-only": "sk-chat-" + uuid.uuid4().hex,
    "slow": "sk-slow-" + uuid.uuid4().hex,
}
ROUTES = ["/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score", "/classify", "/pooling"]
BODIES: dict[str, dict[str, Any]] = {
    "/v1/rerank": {"query": "capital of France", "documents": ["Paris is in France.", "Berlin is in Germany."]},
    "/v1/score": {"text_1": "capital of France", "text_2": ["Paris", "Berlin"]},
    "/classify": {"input": ["great product", "awful service"]},
    "/pooling": {"input": "pool me"},
}
for _alias, _canonical in (("/rerank", "/v1/rerank"), ("/v2/rerank", "/v1/rerank"), ("/score", "/v1/score")):
    BODIES[_alias] = BODIES[_canonical]


class PoolingWorker:
    """A pooling model's vLLM server: answers the model-addressed routes (and /health); anything else is the
    web framework's bare 404, as vLLM answers a route its model does not serve."""

    def __init__(self, served: list[str]) -> None:
        self.served = served
        self.requests: list[tuple[str, dict[str, Any]]] = []  # what it answered
        self.asked: list[str] = []  # every path asked (but /health)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        if path != "/health":
            self.asked.append(path)
        if path == "/health":
            status, answer = 200, {}
        elif path in self.served:
            payload = orjson.loads(body)
            self.requests.append((path, payload))
            answer = {
                "id": "x",
                "model": payload.get("model"),
                "route": path,
                "usage": {"prompt_tokens": 7, "total_tokens": 7},
            }
            status = 400 if payload.get("query") == "bad" else 200
            if status == 400:
                answer = {"object": "error", "message": "query is bad", "type": "BadRequestError", "code": 400}
        else:
            status, answer = 404, {"detail": "Not Found"}
        raw = orjson.dumps(answer)
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
        )
        await send({"type": "http.response.body", "body": raw})


@pytest.fixture
def setup(
    gateway_factory: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[ServerThread, PoolingWorker, PoolingWorker]]:
    monkeypatch.setenv("GATEWAY_TENANCY_PEPPER", PEPPER)
    prefix = f"test:mroutes:{uuid.uuid4().hex[:12]}"
    keys = [
        {"id": "all", "tenant": "acme", "hash": hash_key(KEYS["all"], PEPPER.encode())},
        {"id": "chat-only", "tenant": "acme", "hash": hash_key(KEYS["chat-only"], PEPPER.encode()), "models": ["m1"]},
        {"id": "slow", "tenant": "acme", "hash": hash_key(KEYS["slow"], PEPPER.encode()),
         "limits": {"requests_per_minute": 2}},
    ]  # fmt: skip
    rules = [{"id": "email", "kind": "email", "action": "block"}]
    config = {
        "models": [
            {"name": "m1", "workers": []},  # a generative model: its worker serves none of these
            {"name": "reranker", "aliases": ["bge"], "served_name": "BAAI/bge-reranker", "workers": []},
        ],
        "plugins": [
            {"name": "tenancy", "config": {"redis_prefix": prefix, "keys": keys}},
            {"name": "safety", "config": {"rules": rules}},
            {"name": "routing"},
        ],
        "upstream": {"connect_timeout_s": 1, "first_byte_timeout_s": 5, "idle_timeout_s": 2, "health_interval_s": 0.5},
        "limits": {"max_body_bytes": 64 * 1024},
    }
    worker, generative = PoolingWorker(ROUTES), PoolingWorker([])
    with ServerThread(worker) as pooling, ServerThread(generative) as chat:
        config["models"][0]["workers"] = [chat.url]  # type: ignore[index]
        config["models"][1]["workers"] = [pooling.url]  # type: ignore[index]
        with gateway_factory(config) as (_, server):
            yield server, worker, generative
    client = redis.Redis()
    stale = list(client.scan_iter(match=f"{prefix}*"))
    if stale:
        client.delete(*stale)
    client.close()


def post(server: ServerThread, path: str, body: dict[str, Any], key: str | None = "all") -> httpx.Response:
    headers = {"authorization": f"Bearer {KEYS[key]}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=10)


def error(reply: httpx.Response) -> tuple[int, str | None]:
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return reply.status_code, body["error"]["code"]


@pytest.mark.parametrize("path", ROUTES)
def test_each_route_goes_to_a_worker_of_the_bodys_model(
    setup: tuple[ServerThread, PoolingWorker, PoolingWorker], path: str
) -> None:
    server, worker, generative = setup
    reply = post(server, path, {"model": "bge", **BODIES[path]})
    assert reply.status_code == 200, reply.text
    assert reply.json()["route"] == path and reply.json()["model"] == "BAAI/bge-reranker"
    # with tenancy, each request carries its tenant's cache_salt (plugins/tenancy/prefix_salt.py)
    assert worker.requests[-1] == (path, {**BODIES[path], "model": "BAAI/bge-reranker", "cache_salt": salt_of("acme")})

    # a model none of whose workers serves the route: a 404 that says so, nothing retried
    missing = post(server, path, {"model": "m1", **BODIES[path]})
    assert error(missing) == (404, "unsupported_endpoint")
    named = {"/rerank": "/v1/rerank", "/score": "/v1/score"}.get(path, path)  # the same route on vLLM
    assert f"The model 'm1' does not support {named}:" in missing.json()["error"]["message"]
    assert generative.asked == [path]  # asked once: a route it lacks is not retried elsewhere


def test_refusals_have_openais_shape_and_reach_no_worker(
    setup: tuple[ServerThread, PoolingWorker, PoolingWorker],
) -> None:
    server, worker, _ = setup
    rerank = {"model": "reranker", **BODIES["/v1/rerank"]}
    assert error(post(server, "/v1/rerank", rerank, key=None)) == (401, "invalid_api_key")
    assert error(post(server, "/v1/rerank", rerank, key="chat-only")) == (404, "model_not_found")  # not its model
    assert error(post(server, "/v1/rerank", {**rerank, "model": "nope"})) == (404, "model_not_found")
    assert error(post(server, "/classify", {"model": "reranker", "input": "x", "priority": -100})) == (
        400,
        "unsupported_parameter",
    )
    assert error(post(server, "/v1/score", {**rerank, "stream": True}))[0] == 400
    assert error(post(server, "/pooling", {"model": "reranker", "input": "x" * 70_000}))[0] == 413
    assert error(post(server, "/v1/rerank", {**rerank, "documents": ["mail alice@example.org now"]})) == (
        400,
        "content_filter",
    )  # safety reads the documents
    internal = {"content": [{"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest"}}]}
    assert error(post(server, "/v1/rerank", {**rerank, "documents": [internal]})) == (400, "url_not_allowed")
    assert worker.requests == []
    # the worker's own refusal comes back in OpenAI's shape
    assert error(post(server, "/v1/rerank", {**rerank, "query": "bad"}))[0] == 400


def test_request_limits_apply(setup: tuple[ServerThread, PoolingWorker, PoolingWorker]) -> None:
    server, worker, _ = setup
    replies = [post(server, "/score", {"model": "reranker", **BODIES["/score"]}, key="slow") for _ in range(5)]
    assert replies[0].status_code == 200
    limited = [r for r in replies if r.status_code == 429]
    assert limited and error(limited[0])[0] == 429 and limited[0].json()["error"]["type"] == "rate_limit_error"
    assert len(worker.requests) == 5 - len(limited)
