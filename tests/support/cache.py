"""Shared pieces of the cache tests (no tests here): Redis fixtures, tiny plugins, request helpers."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis

from gateway.pipeline.context import ModelResponse, RequestContext
from gateway.pipeline.plugin import Plugin
from gateway.wire.errors import BadGateway
from plugins.cache import CachePlugin
from plugins.cache.keys import CacheKey, backing_of, make_key
from tests.support.fakes import free_port
from tests.support.gateways import base_config

REDIS_URL = "redis://127.0.0.1:6379/0"
PREFIX = "gwcache"
MESSAGES = [{"role": "user", "content": "hi"}]


class TenantFromHeader(Plugin):
    """Sets ``ctx.tenant`` from an ``x-tenant`` header (stands in for the tenancy plugin)."""

    name = "tenant_from_header"

    async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
        ctx.tenant = ctx.headers.get("x-tenant")
        return None


class RejectOnHeader(Plugin):
    """Placed after the cache: fails the answer on the way back when ``x-reject`` is sent, like an
    output validator whose check failed."""

    name = "reject_on_header"

    async def on_response(self, ctx: RequestContext, response: ModelResponse) -> ModelResponse | None:
        if ctx.headers.get("x-reject"):
            raise BadGateway("The answer failed validation.", code="validation_failed")
        return None


PLUGINS: dict[str, type[Plugin]] = {
    "cache": CachePlugin,
    "tenant_from_header": TenantFromHeader,
    "reject_on_header": RejectOnHeader,
}


def cache_gateway_config(
    upstream_url: str, namespace: str, *, before: tuple[str, ...] = (), after: tuple[str, ...] = (), **cache: Any
) -> dict[str, Any]:
    plugins = [{"name": n} for n in before]
    plugins.append({"name": "cache", "config": {"namespace": namespace, "timeout_ms": 100, **cache}})
    plugins += [{"name": n} for n in after]
    plugins.append({"name": "routing"})
    return base_config([upstream_url], plugins=plugins)


def public_entry_key(config: dict[str, Any], namespace: str, body: dict[str, Any], model: str = "m1") -> CacheKey:
    """The key under which a gateway running ``config`` (``cache_gateway_config``) keeps the answer to a
    chat ``body`` for ``model`` asked without a tenant, the model's backing included."""
    workers = next(m["workers"] for m in config["models"] if m["name"] == model)
    return make_key(
        prefix=PREFIX,
        namespace=namespace,
        tenant=None,
        default_scope="public",
        endpoint="chat/completions",
        model=model,
        body=body,
        backing=backing_of(model, workers, {}),
    )


def delete_namespace(client: redis.Redis, namespace: str) -> None:
    names = list(client.scan_iter(match=f"{PREFIX}:{namespace}:*", count=1000))
    if names:
        client.delete(*names)


def entry_names(client: redis.Redis, namespace: str) -> list[bytes]:
    return list(client.scan_iter(match=f"{PREFIX}:{namespace}:e:*", count=1000))


def wait_stored(client: redis.Redis, namespace: str, count: int = 1, timeout_s: float = 20.0) -> None:
    """Stores happen in the background after the reply: wait (bounded) until ``count`` entries exist."""
    deadline = time.monotonic() + timeout_s
    while len(entry_names(client, namespace)) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"expected {count} cache entries in namespace {namespace}")
        time.sleep(0.005)


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()


@pytest.fixture
def namespace(redis_client: redis.Redis) -> Iterator[str]:
    """A namespace of this test's own; its keys are deleted afterwards."""
    ns = "t" + uuid.uuid4().hex[:12]
    yield ns
    delete_namespace(redis_client, ns)


class ThrowawayRedis:
    """A private redis-server (no persistence) that a test may stop, restart and pause."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary is not None, "redis-server is needed for the fault tests"
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--save", "", "--appendonly", "no", "--bind", "127.0.0.1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                with redis.Redis(port=self.port, socket_timeout=0.5) as probe:
                    probe.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=30)


@pytest.fixture
def throwaway_redis() -> Iterator[ThrowawayRedis]:
    server = ThrowawayRedis()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def chat(url: str, *, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    payload = {"model": "m1", "messages": MESSAGES, "temperature": 0, **body}
    return httpx.post(url + "/v1/chat/completions", json=payload, headers=headers or {}, timeout=30)


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def sdk_chat(url: str, *, stream: bool, extra_headers: dict[str, str] | None = None, **body: Any) -> tuple[str, Any]:
    """(x-cache, parsed) through the openai SDK: a ChatCompletion, or the list of stream chunks."""
    params: dict[str, Any] = {"model": "m1", "messages": MESSAGES, "temperature": 0, **body}
    raw = sdk(url).chat.completions.with_raw_response.create(stream=stream, extra_headers=extra_headers, **params)
    parsed = raw.parse()
    return raw.headers.get("x-cache", ""), (list(parsed) if stream else parsed)


def stream_text(chunks: list[Any], index: int = 0) -> str:
    return "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices if c.index == index)
