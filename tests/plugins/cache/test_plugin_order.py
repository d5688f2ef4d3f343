"""The cache and the plugins that check answers, in either order in ``plugins``, through the gateway
with real Redis. ``on_request`` runs in list order and ``on_response`` / ``on_chunk`` in reverse, so:

- guided_json listed before the cache would have the cache keep each answer before guided_json retried
  it, refused it or marked it no-store; such a config is refused (``Plugin.replaces_answers``).
- safety listed before the cache (where it screens prompts before a hit can answer) sees every answer
  the cache gives back: its output rules apply to hits as to fresh answers.
- safety listed after the cache changes a stream's events before the cache records them: what the
  cache keeps is the answer as safety left it, for streamed and whole requests alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import redis

from plugins.cache import CachePlugin
from plugins.guided_json import GuidedJSONPlugin
from plugins.safety import SafetyPlugin
from tests.plugins.cache.test_with_guided_json import VALID, LimitedWorker, _chat, _streamed, _whole
from tests.server.test_app_lifecycle import read_body
from tests.support.cache import entry_names, namespace, redis_client, wait_stored
from tests.support.fakes import ServerThread
from tests.support.gateways import GatewayFactory, base_config

__all__ = ["namespace", "redis_client"]  # fixtures used by name below

PLUGINS = {"cache": CachePlugin, "guided_json": GuidedJSONPlugin, "safety": SafetyPlugin}
ANSWER = "the code is zz1234, keep it"
REDACT = {"id": "codes", "kind": "pattern", "patterns": ["zz[0-9]+"], "action": "redact", "apply_to": ["output"]}
BLOCK = {**REDACT, "action": "block"}


def _sections(namespace: str, order: list[str], rule: dict[str, Any]) -> list[dict[str, Any]]:
    sections = {
        "cache": {"name": "cache", "config": {"namespace": namespace, "timeout_ms": 100}},
        "guided_json": {"name": "guided_json", "config": {"probe": False, "compile_timeout_ms": 30_000}},
        "safety": {"name": "safety", "config": {"rules": [rule]}},
    }
    return [sections[name] for name in order] + [{"name": "routing"}]


@pytest.fixture
def gateway(gateway_factory: GatewayFactory, namespace: str) -> Iterator[Any]:
    """``gateway(worker, order, rule=REDACT)`` -> (the gateway's URL, the config's dict builder)."""
    stack = contextlib.ExitStack()

    def start(worker: LimitedWorker, order: list[str], rule: dict[str, Any] = REDACT) -> tuple[str, Any]:
        worker_url = stack.enter_context(ServerThread(worker, lifespan="off")).url

        def config(order: list[str]) -> dict[str, Any]:
            return base_config([worker_url], plugins=_sections(namespace, order, rule))

        _, server = stack.enter_context(gateway_factory(config(order), plugins=PLUGINS, admin_token="adm"))
        return str(server.url), config

    with stack:
        yield start


# -- guided_json before the cache: refused --------------------------------------------------------


def test_a_config_listing_guided_json_before_the_cache_is_refused(
    gateway: Any, redis_client: redis.Redis, namespace: str
) -> None:
    """Listed first, guided_json's on_response would run after the cache's: the cache would store a whole
    answer cut by the worker's limit before guided_json retried it, and serve that cut answer (200,
    finish_reason "length") to the next identical request, where there is no worker to retry with; store
    a stream guided_json then marks no-store; and store an invalid answer before guided_json refused it.
    An admin reload to that order is answered 400 naming both, and the running config serves on."""
    worker = LimitedWorker(VALID, default_limit=4)
    url, config = gateway(worker, ["cache", "guided_json"])

    def reload(order: list[str]) -> httpx.Response:
        return httpx.put(
            url + "/admin/config", content=orjson.dumps(config(order)), headers={"authorization": "Bearer adm"}
        )

    refused = reload(["guided_json", "cache"])
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert "'cache' must come before 'guided_json'" in message
    # the running config serves on: the cut answer retried, and the retried answer stored and served
    assert _whole(_chat(url)) == (VALID, "stop")
    wait_stored(redis_client, namespace)
    again = _chat(url)
    assert again.headers["x-cache"] == "hit" and _whole(again) == (VALID, "stop")
    assert [b.get("max_tokens") for b in worker.bodies] == [None, 2048]
    assert reload(["safety", "cache", "guided_json"]).status_code == 200


def test_the_shipped_plugins_refuse_guided_json_before_the_cache(namespace: str) -> None:
    """What the gateway loads at start-up and on a reload (through the installed entry points): the order
    is refused with the cache listed anywhere after guided_json, and taken the other way round."""
    from gateway.pipeline.config import ConfigError, GatewayConfig
    from gateway.pipeline.registry import PluginRegistry
    from gateway.pipeline.validate import resolve_plugins

    def resolve(order: list[str]) -> list[str]:
        config = GatewayConfig.model_validate(
            base_config(["http://127.0.0.1:9"], plugins=_sections(namespace, order, REDACT))
        )
        return [item.entry.name for item in resolve_plugins(config, PluginRegistry())]

    for order in (["guided_json", "cache"], ["guided_json", "safety", "cache"]):
        with pytest.raises(ConfigError, match="'cache' must come before 'guided_json'"):
            resolve(order)
    assert resolve(["safety", "cache", "guided_json"]) == ["safety", "cache", "guided_json", "routing"]
    assert resolve(["cache", "guided_json", "safety"]) == ["cache", "guided_json", "safety", "routing"]


# -- safety's output rules, in either order --------------------------------------------------------


def _content(reply: httpx.Response, stream: bool) -> tuple[str, str | None]:
    if stream:
        text, finish, errors = _streamed(reply)
        assert errors == []
        return text, finish
    return _whole(reply)


def _ask(url: str, stream: bool) -> httpx.Response:
    body = {"model": "m1", "messages": [{"role": "user", "content": "the code?"}], "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=30)


@pytest.mark.parametrize("order", [["safety", "cache"], ["cache", "safety"]], ids=["safety_first", "cache_first"])
@pytest.mark.parametrize("first", [False, True], ids=["whole_miss", "stream_miss"])
@pytest.mark.parametrize("then", [False, True], ids=["whole_hit", "stream_hit"])
def test_an_answer_safety_redacts_is_redacted_on_every_hit(
    gateway: Any, redis_client: redis.Redis, namespace: str, order: list[str], first: bool, then: bool
) -> None:
    """Whichever shape stored the answer and whichever shape hits it, the client of a hit gets the
    answer as safety's output rules leave it, as the client of the miss did."""
    worker = LimitedWorker(ANSWER)
    url, _ = gateway(worker, order)
    redacted = ("the code is [REDACTED], keep it", "stop")
    miss = _ask(url, first)
    assert miss.headers["x-cache"] == "miss" and _content(miss, first) == redacted
    wait_stored(redis_client, namespace)
    hit = _ask(url, then)
    assert hit.headers["x-cache"] == "hit"
    assert _content(hit, then) == redacted
    assert len(worker.bodies) == 1


class LastPieceWorker(LimitedWorker):
    """Streams its pieces with the last one and ``finish_reason`` in the same event, as vLLM ends an
    answer cut by a token limit; whole answers as ``LimitedWorker``."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] != "/v1/chat/completions":  # the health checks
            await super().__call__(scope, receive, send)
            return
        body = orjson.loads(await read_body(receive))
        if not body.get("stream"):
            raise AssertionError("only streams are asked of this worker")
        self.bodies.append(body)
        pieces = [self.text[i : i + 3] for i in range(0, len(self.text), 3)]
        base = {"id": "chatcmpl-w", "object": "chat.completion.chunk", "created": 1, "model": body.get("model")}
        deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}, *({"content": p} for p in pieces)]
        last = len(deltas) - 1
        events = [
            {**base, "choices": [{"index": 0, "delta": d, "finish_reason": "length" if i == last else None}]}
            for i, d in enumerate(deltas)
        ]
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for event in events:
            data = b"data: " + orjson.dumps(event) + b"\n\n"
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


@pytest.mark.parametrize("order", [["safety", "cache"], ["cache", "safety"]], ids=["safety_first", "cache_first"])
@pytest.mark.parametrize("then", [False, True], ids=["whole_hit", "stream_hit"])
def test_a_stream_safety_blocked_is_not_served_unblocked(
    gateway: Any, redis_client: redis.Redis, namespace: str, order: list[str], then: bool
) -> None:
    """The worker's last event carries the blocked text and ends the answer: safety cuts the stream there
    with finish_reason content_filter. No later request, whole or streamed, gets the blocked text from
    the cache. Listed after the cache, safety has cut the stream before the cache keeps it: no entry
    holds the text (listed before, the entry keeps the worker's answer and safety cuts every hit)."""
    worker = LastPieceWorker(ANSWER[:15])  # "the code is zz1": the match is in the last piece
    url, _ = gateway(worker, order, rule=BLOCK)
    blocked = _content(_ask(url, True), True)
    assert blocked == ("the code is ", "content_filter")
    wait_stored(redis_client, namespace)
    later = _ask(url, then)
    assert later.headers["x-cache"] == "hit"
    assert _content(later, then) == blocked
    [name] = entry_names(redis_client, namespace)
    if order[0] == "cache":
        assert b"zz1" not in redis_client.get(name)
