"""The cache in front of guided_json (the default order: the cache's ``on_response`` runs after
guided_json's, so it sees what guided_json let through or put in place of the worker's answer). What
must hold: an answer guided_json refused is never stored; an answer cut by the client's own limit is
stored like any other (the same request gets the same cut answer); and an answer cut by the worker's
own limit, which guided_json retries for a whole request but cannot for a stream, is never served to
other requests in place of the retried one, nor written over the retried one."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson
import pytest
import redis

from plugins.cache import CachePlugin
from plugins.guided_json import GuidedJSONPlugin
from tests.server.test_app_lifecycle import read_body
from tests.support.cache import entry_names, namespace, redis_client, wait_stored
from tests.support.fakes import ServerThread
from tests.support.gateways import GatewayFactory, base_config

__all__ = ["namespace", "redis_client"]  # fixtures used by name below

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
VALID = '{"name": "a", "age": 4}'
PLUGINS = {"cache": CachePlugin, "guided_json": GuidedJSONPlugin}
GUIDED = {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}


class LimitedWorker:
    """A vLLM-like worker whose answer is ``text`` in tokens of three characters, cut at the request's
    ``max_tokens`` or, without one, at the worker's own ``default_limit`` (vLLM's generation config, or
    its 16 tokens for legacy completions): ``finish_reason`` "length" when cut. Streams in vLLM's compact
    events, ``pace_s`` apart; records every request body."""

    def __init__(self, text: str, default_limit: int | None = None, pace_s: float = 0.0) -> None:
        self.text = text
        self.default_limit = default_limit
        self.pace_s = pace_s
        self.bodies: list[dict[str, Any]] = []
        self.streams_ended: list[str] = []  # "done" or "gone" (the gateway went away), per stream

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] != "/v1/chat/completions":
            await _send(send, 200, b"{}", b"application/json")
            return
        body = orjson.loads(await read_body(receive))
        self.bodies.append(body)
        pieces = [self.text[i : i + 3] for i in range(0, len(self.text), 3)]
        limit = body.get("max_tokens") or body.get("max_completion_tokens") or self.default_limit
        finish = "stop"
        if isinstance(limit, int) and limit < len(pieces):
            pieces, finish = pieces[:limit], "length"
        usage = {"prompt_tokens": 5, "completion_tokens": len(pieces), "total_tokens": 5 + len(pieces)}
        base = {"id": "chatcmpl-w", "object": "chat.completion", "created": 1, "model": body.get("model")}
        if not body.get("stream"):
            message = {"role": "assistant", "content": "".join(pieces)}
            answer = {**base, "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage}
            await _send(send, 200, orjson.dumps(answer), b"application/json")
            return
        base["object"] = "chat.completion.chunk"
        deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}, *({"content": p} for p in pieces), {}]
        events = [
            {**base, "choices": [{"index": 0, "delta": d, "finish_reason": finish if i == len(deltas) - 1 else None}]}
            for i, d in enumerate(deltas)
        ]
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({**base, "choices": [], "usage": usage})
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            for event in events:
                data = b"data: " + orjson.dumps(event) + b"\n\n"
                await send({"type": "http.response.body", "body": data, "more_body": True})
                await asyncio.sleep(self.pace_s)
                if gone.done():
                    self.streams_ended.append("gone")
                    return
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        except OSError:  # the server's way of saying the gateway went away, in some versions
            self.streams_ended.append("gone")
            return
        finally:
            gone.cancel()
        self.streams_ended.append("done")


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send(send: Any, status: int, payload: bytes, media_type: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", media_type)]})
    await send({"type": "http.response.body", "body": payload})


@pytest.fixture
def gateway(gateway_factory: GatewayFactory, namespace: str) -> Iterator[Any]:
    """``gateway(worker, **guided_json_config)`` -> the gateway's URL: the cache, then guided_json."""
    stack = contextlib.ExitStack()

    def start(worker: LimitedWorker, **guided: Any) -> str:
        worker_server = stack.enter_context(ServerThread(worker, lifespan="off"))
        plugins = [
            {"name": "cache", "config": {"namespace": namespace, "timeout_ms": 100}},
            # a compile budget that a busy test machine cannot run over (its refusal is a 400)
            {"name": "guided_json", "config": {"probe": False, "compile_timeout_ms": 30_000, **guided}},
            {"name": "routing"},
        ]
        _, server = stack.enter_context(
            gateway_factory(base_config([worker_server.url], plugins=plugins), plugins=PLUGINS)
        )
        return str(server.url)

    with stack:
        yield start


def _chat(url: str, *, headers: dict[str, str] | None = None, **fields: Any) -> httpx.Response:
    body = {"model": "m1", "messages": [{"role": "user", "content": "who?"}], "temperature": 0, **GUIDED, **fields}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=30)


def _streamed(reply: httpx.Response) -> tuple[str, str | None, list[dict[str, Any]]]:
    """(content, finish_reason, error events) of a streamed reply."""
    assert reply.status_code == 200, reply.text
    payloads = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    chunks = [orjson.loads(p) for p in payloads[:-1]]
    errors = [c for c in chunks if "error" in c]
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    text = "".join(c["delta"].get("content") or "" for c in choices)
    finish = next((c["finish_reason"] for c in reversed(choices) if c.get("finish_reason")), None)
    return text, finish, errors


def _whole(reply: httpx.Response) -> tuple[str, str]:
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_that_fails_validation_is_not_stored(
    gateway: Any, redis_client: redis.Redis, namespace: str, stream: bool
) -> None:
    """A complete answer guided_json refuses (422, or a stream's error event) is never stored: the same
    request goes to the worker again and is refused again, never served the invalid answer."""
    worker = LimitedWorker('{"name": "a", "age": "old"}')
    url = gateway(worker)
    for _ in range(2):  # the second is looked up after the first's store, if any, was sent (in order)
        reply = _chat(url, stream=stream)
        if stream:
            _, _, errors = _streamed(reply)
            assert reply.headers["x-cache"] == "miss"
            assert [e["error"]["code"] for e in errors] == ["guided_output_invalid"]
        else:
            assert reply.status_code == 422 and reply.json()["error"]["code"] == "guided_output_invalid", reply.text
    assert len(worker.bodies) == 2  # both went to the worker: the first was not stored
    assert entry_names(redis_client, namespace) == []


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_cut_by_the_clients_limit_is_stored_and_served_as_it_is(
    gateway: Any, redis_client: redis.Redis, namespace: str, stream: bool
) -> None:
    """The client's max_tokens is in the key: its cut answer is the answer to that request, whichever
    shape asked first (guided_json never raises a client's limit)."""
    worker = LimitedWorker(VALID)
    url = gateway(worker)
    first = _chat(url, max_tokens=4, stream=stream)
    cut = _streamed(first)[:2] if stream else _whole(first)
    assert cut == (VALID[:12], "length") and first.headers["x-cache"] == "miss"
    wait_stored(redis_client, namespace)
    whole, streamed = _chat(url, max_tokens=4), _chat(url, max_tokens=4, stream=True)
    assert whole.headers["x-cache"] == streamed.headers["x-cache"] == "hit"
    assert _whole(whole) == _streamed(streamed)[:2] == cut
    assert [b.get("max_tokens") for b in worker.bodies] == [4]


def test_a_stream_cut_by_the_workers_limit_does_not_stand_in_for_the_retried_answer(
    gateway: Any, redis_client: redis.Redis, namespace: str
) -> None:
    """Without a client limit, a whole answer the worker's own limit cut is retried by guided_json with a
    budget, and a stream cannot be: a stream's cut answer, stored under the key both shapes share, would
    then be served to whole requests in place of the valid answer they get from the worker."""
    worker = LimitedWorker(VALID, default_limit=4)
    url = gateway(worker)
    assert _streamed(_chat(url, stream=True))[:2] == (VALID[:12], "length")  # what a stream gets live
    whole = _chat(url)
    assert _whole(whole) == (VALID, "stop")
    assert whole.headers["x-cache"] == "miss"
    assert [b.get("max_tokens") for b in worker.bodies] == [None, None, 2048]  # the stream, the whole, its retry
    # the retried answer is stored, and served to either shape from then on
    wait_stored(redis_client, namespace)
    again, streamed = _chat(url), _chat(url, stream=True)
    assert again.headers["x-cache"] == streamed.headers["x-cache"] == "hit"
    assert _whole(again) == _streamed(streamed)[:2] == (VALID, "stop")
    assert len(worker.bodies) == 3


def test_a_whole_request_waiting_on_a_cut_stream_gets_the_retried_answer(
    gateway: Any, redis_client: redis.Redis, namespace: str
) -> None:
    """Identical requests coalesce whatever their shape: a whole request that arrives while a stream
    computes the answer waits for it. A cut stream's answer is not stored, so the whole request goes to
    the worker when the stream ends, and is retried, instead of being handed the cut answer."""
    worker = LimitedWorker(VALID, default_limit=4, pace_s=0.2)
    url = gateway(worker)
    body = {"model": "m1", "messages": [{"role": "user", "content": "who?"}], "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, **GUIDED}, timeout=30) as streamed:
        lines = streamed.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # the stream holds the lock by now
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(_chat, url)
            rest = list(lines)
            whole = waiting.result(timeout=30)
    assert "data: [DONE]" in rest
    assert _whole(whole) == (VALID, "stop") and whole.headers["x-cache"] == "miss"
    assert [b.get("max_tokens") for b in worker.bodies] == [None, None, 2048]


def test_without_retries_a_stream_cut_by_the_workers_limit_is_stored_as_a_whole_request_gets_it(
    gateway: Any, redis_client: redis.Redis, namespace: str
) -> None:
    """Under ``on_invalid: error`` nothing is retried: both shapes get the cut answer live, so the
    stream's is stored and served to whole requests."""
    worker = LimitedWorker(VALID, default_limit=4)
    url = gateway(worker, on_invalid="error")
    assert _streamed(_chat(url, stream=True))[:2] == (VALID[:12], "length")
    wait_stored(redis_client, namespace)
    whole = _chat(url)
    assert whole.headers["x-cache"] == "hit"
    assert _whole(whole) == (VALID[:12], "length")
    assert len(worker.bodies) == 1


def test_a_stream_cut_by_the_workers_limit_does_not_replace_the_retried_answer(
    gateway: Any, redis_client: redis.Redis, namespace: str
) -> None:
    """A stream that does not look the cache up (``Cache-Control: no-cache``) still stores its answer,
    over the entry: its cut answer must not take the place of the retried one."""
    worker = LimitedWorker(VALID, default_limit=4)
    url = gateway(worker)
    assert _whole(_chat(url)) == (VALID, "stop")
    wait_stored(redis_client, namespace)
    [name] = entry_names(redis_client, namespace)
    stored = redis_client.get(name)
    fresh = _chat(url, stream=True, headers={"cache-control": "no-cache"})
    assert _streamed(fresh)[:2] == (VALID[:12], "length")
    after = _chat(url)  # looked up after the stream's store, if any, was sent (one connection, in order)
    assert after.headers["x-cache"] == "hit"
    assert _whole(after) == (VALID, "stop")
    assert redis_client.get(name) == stored


def test_a_stream_whose_client_went_away_is_not_stored(gateway: Any, redis_client: redis.Redis, namespace: str) -> None:
    """The client reads one event and goes away; the worker would have finished the (valid) answer."""
    worker = LimitedWorker(VALID, pace_s=0.1)
    url = gateway(worker)
    body = {
        "model": "m1",
        "messages": [{"role": "user", "content": "who?"}],
        "temperature": 0,
        "stream": True,
        **GUIDED,
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as reply:
        assert reply.headers["x-cache"] == "miss"
        for line in reply.iter_lines():
            if line.startswith("data: "):
                break
    deadline = time.monotonic() + 20
    while not worker.streams_ended:
        assert time.monotonic() < deadline, "the worker's stream neither ended nor saw the gateway go away"
        time.sleep(0.02)
    assert worker.streams_ended == ["gone"]
    again = _chat(url)
    assert again.headers["x-cache"] == "miss"
    assert _whole(again) == (VALID, "stop")
    assert len(worker.bodies) == 2
