"""Mid-stream failover: a worker that breaks (connection dropped) or goes silent (idle timeout) after a
stream started is replaced by another worker continuing the same answer, and the client sees one stream.

Two fake workers on real sockets: the doomed one (listed first, round robin sends it the first request)
and a survivor that continues deterministically from the text in the continuation request. Both the
byte pass-through path and the parsed path (a plugin with ``on_chunk``) are covered.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import redis

from gateway.pipeline.context import RequestContext
from gateway.pipeline.plugin import Plugin
from gateway.server.app import GatewayApp
from tests.support.cache import PLUGINS, cache_gateway_config, entry_names, namespace, redis_client
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config

__all__ = ["namespace", "redis_client"]  # fixtures used by name below

TEXT = "The quick brown fox jumps over the lazy dog, again and again."
PIECES = 12
CHAT = {"model": "m1", "messages": [{"role": "user", "content": "tell me"}], "stream": True}
COMPLETION = {"model": "m1", "prompt": "Once upon a time:", "stream": True}
USAGE = {"stream_options": {"include_usage": True}}


class Inspect(Plugin):
    """Forces the parsed-stream path and records what the plugins see."""

    seen: list[dict[str, Any]] = []
    resumed: list[int] = []

    async def on_chunk(self, ctx: RequestContext, chunk: dict[str, Any]) -> dict[str, Any] | None:
        Inspect.seen.append(chunk)
        return chunk

    async def on_response(self, ctx: RequestContext, response: Any) -> None:
        Inspect.resumed.append(ctx.resumed)
        return None


@pytest.fixture(scope="module")
def survivor_server() -> Iterator[tuple[FakeUpstream, ServerThread]]:
    fake = FakeUpstream(name="survivor")
    with ServerThread(fake) as server:
        yield fake, server


@pytest.fixture
def doomed(upstream: FakeUpstream) -> FakeUpstream:
    upstream.behavior.text, upstream.behavior.chunks = TEXT, PIECES
    return upstream


@pytest.fixture
def urls(upstream_url: str, survivor_server: tuple[FakeUpstream, ServerThread]) -> list[str]:
    """The two workers in routing order: the doomed one first, then the survivor."""
    return [upstream_url, survivor_server[1].url]


@pytest.fixture
def survivor(survivor_server: tuple[FakeUpstream, ServerThread]) -> Iterator[FakeUpstream]:
    fake, _ = survivor_server
    fake.reset()
    fake.healthy = True
    fake.behavior.text, fake.behavior.chunks = TEXT, PIECES
    yield fake
    fake.reset()
    fake.healthy = True


def config(urls: list[str], *, parsed: bool, resumptions: int = 1, **plugins_extra: Any) -> dict[str, Any]:
    routing = {"name": "routing", "config": {"default": {"policy": "round_robin"}}}
    plugins = [{"name": "inspect"}, routing] if parsed else [routing]
    cfg = base_config(urls, plugins=plugins)
    cfg["upstream"] = {**cfg["upstream"], "idle_timeout_s": 1, "stream_resumptions": resumptions}
    return cfg


def events_of(text: str) -> list[Any]:
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


def post_stream(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    with httpx.stream("POST", url + path, json=body, timeout=30) as response:
        assert response.status_code == 200
        return events_of(response.read().decode())


def text_of(chunks: list[dict[str, Any]], chat: bool) -> str:
    key = "delta" if chat else None
    parts = []
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            parts.append((choice[key].get("content") if key else choice.get("text")) or "")
    return "".join(parts)


def resumptions(app: GatewayApp, reason: str) -> float:
    value = app.state.services.metrics.registry.get_sample_value(
        "gateway_stream_resumptions_total", {"model": "m1", "reason": reason}
    )
    return value or 0.0


@pytest.mark.parametrize("parsed", [False, True], ids=["bytes", "parsed"])
@pytest.mark.parametrize("failure", ["die", "hang"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_cut_stream_is_continued_on_another_worker_as_one_stream(
    gateway_factory: GatewayFactory,
    doomed: FakeUpstream,
    survivor: FakeUpstream,
    urls: list[str],
    parsed: bool,
    failure: str,
    endpoint: str,
) -> None:
    chat = endpoint == "chat"
    setattr(doomed.behavior, f"{failure}_after", 5)  # chat: the role chunk and 4 pieces; completions: 5 pieces
    sent_before = 4 if chat else 5
    Inspect.seen, Inspect.resumed = [], []
    with gateway_factory(config(urls, parsed=parsed), plugins={"inspect": Inspect}) as (app, server):
        body, path = (CHAT, "/v1/chat/completions") if chat else (COMPLETION, "/v1/completions")
        events = post_stream(server.url, path, {**body, **USAGE})
        reason = resumptions(app, "reset" if failure == "die" else "idle")
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    assert not [c for c in chunks if "error" in c], chunks
    # One stream: the first worker's id/created/model throughout, the text continues where it stopped.
    assert text_of(chunks, chat) == TEXT
    assert {(c["id"], c["created"], c["model"]) for c in chunks} == {(chunks[0]["id"], 1, "m1")}
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
    assert finishes == ["stop"]
    if chat:
        assert sum(1 for c in chunks for ch in c["choices"] if "role" in ch["delta"]) == 1
    # Usage: the prompt once, every completion token the client received.
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    pieces = len(_pieces())
    assert usage == {"prompt_tokens": 5, "completion_tokens": pieces, "total_tokens": 5 + pieces}
    # The continuation the survivor was asked for.
    assert len(doomed.requests) == 1 and len(survivor.requests) == 1
    prefix = "".join(_pieces()[:sent_before])
    asked = survivor.requests[0].body
    if chat:
        assert asked["messages"] == [*CHAT["messages"], {"role": "assistant", "content": prefix}]
        assert asked["continue_final_message"] is True and asked["add_generation_prompt"] is False
    else:
        assert asked["prompt"] == COMPLETION["prompt"] + prefix
    assert reason == 1
    if parsed:  # the plugins saw one stream, and knew it was resumed
        assert Inspect.resumed == [1]
        assert text_of(Inspect.seen, chat) == TEXT


def _pieces() -> list[str]:
    size = -(-len(TEXT) // PIECES)
    return [TEXT[i : i + size] for i in range(0, len(TEXT), size)]


@pytest.mark.parametrize("parsed", [False, True], ids=["bytes", "parsed"])
def test_the_continuation_gets_the_remaining_max_tokens(
    gateway_factory: GatewayFactory,
    doomed: FakeUpstream,
    survivor: FakeUpstream,
    urls: list[str],
    parsed: bool,
) -> None:
    doomed.behavior.die_after = 5
    with gateway_factory(config(urls, parsed=parsed), plugins={"inspect": Inspect}) as (_, server):
        events = post_stream(server.url, "/v1/chat/completions", {**CHAT, **USAGE, "max_tokens": 9})
    chunks = events[:-1]
    assert survivor.requests[0].body["max_tokens"] == 9 - 4
    assert text_of(chunks, True) == "".join(_pieces()[:9])
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")] == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 9


@pytest.mark.parametrize("parsed", [False, True], ids=["bytes", "parsed"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("tokenize", ["count", "missing", "hang"])
def test_the_usage_counts_the_request_prompt_not_the_retokenized_continuation(
    gateway_factory: GatewayFactory,
    doomed: FakeUpstream,
    survivor: FakeUpstream,
    urls: list[str],
    parsed: bool,
    endpoint: str,
    tokenize: str,
) -> None:
    """The continuation's prompt holds the sent text retokenized, here 2 tokens more than were generated:
    the usage's prompt is the request's own (the continuing worker's /tokenize of the request as sent), or,
    when that worker cannot count it (no route, or no answer within resume.COUNT_WAIT_S), the
    continuation's prompt less the tokens sent (off by those 2)."""
    chat = endpoint == "chat"
    doomed.behavior.die_after = 5
    survivor.behavior.retokenized_extra = 2
    survivor.behavior.tokenize = tokenize
    body, path = (CHAT, "/v1/chat/completions") if chat else (COMPLETION, "/v1/completions")
    with gateway_factory(config(urls, parsed=parsed), plugins={"inspect": Inspect}) as (_, server):
        events = post_stream(server.url, path, {**body, **USAGE, "temperature": 0})
    chunks = events[:-1]
    assert text_of(chunks, chat) == TEXT
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == (5 if tokenize == "count" else 7)
    assert usage["completion_tokens"] == len(_pieces())
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # The count was asked of the survivor for the request as the first worker got it, in /tokenize's terms.
    (asked,) = survivor.tokenized
    if chat:
        assert asked == {"model": "m1", "messages": CHAT["messages"]}
    else:
        assert asked == {"model": "m1", "prompt": COMPLETION["prompt"]}
    assert not doomed.tokenized


def test_no_prompt_count_is_asked_when_the_client_wants_no_usage(
    gateway_factory: GatewayFactory,
    doomed: FakeUpstream,
    survivor: FakeUpstream,
    urls: list[str],
) -> None:
    doomed.behavior.die_after = 5
    with gateway_factory(config(urls, parsed=False)) as (_, server):
        events = post_stream(server.url, "/v1/chat/completions", CHAT)
    assert text_of(events[:-1], True) == TEXT
    assert not [c for c in events[:-1] if c.get("usage")]
    assert survivor.tokenized == [] and len(survivor.requests) == 1


def test_resumption_is_logged_naming_both_workers(
    gateway_factory: GatewayFactory,
    doomed: FakeUpstream,
    survivor: FakeUpstream,
    urls: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    doomed.behavior.die_after = 5
    with gateway_factory(config(urls, parsed=False), plugins={"inspect": Inspect}) as (_, server):
        post_stream(server.url, "/v1/chat/completions", CHAT)
    warnings = [r.getMessage() for r in caplog.records if r.name == "gateway.proxy" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and urls[0] in warnings[0] and urls[1] in warnings[0]
    access = [r.fields for r in caplog.records if r.name == "gateway.access" and hasattr(r, "fields")]
    assert access[-1]["resumed_from"] == urls[0] and access[-1]["worker"] == urls[1]


def test_no_resumption_beyond_the_retry_budget(
    gateway_factory: GatewayFactory,
    doomed: FakeUpstream,
    survivor: FakeUpstream,
    urls: list[str],
) -> None:
    """A resumption is a retry: with routing's retry budget spent (here: none at all), streams cut midway
    end with one error event instead of adding load to the workers that are left."""
    doomed.behavior.die_after = 5
    cfg = config(urls, parsed=False)
    cfg["plugins"][-1]["config"]["retry_budget"] = {"ratio": 0, "min_per_s": 0}
    with gateway_factory(cfg, plugins={"inspect": Inspect}) as (app, server):
        events = post_stream(server.url, "/v1/chat/completions", CHAT)
        assert resumptions(app, "reset") == 0
    assert len([e for e in events[:-1] if "error" in e]) == 1
    assert survivor.requests == []


@pytest.mark.parametrize("parsed", [False, True], ids=["bytes", "parsed"])
def test_no_resumption_when_the_limit_is_zero(
    gateway_factory: GatewayFactory,
    doomed: FakeUpstream,
    survivor: FakeUpstream,
    urls: list[str],
    parsed: bool,
) -> None:
    doomed.behavior.die_after = 5
    with gateway_factory(config(urls, parsed=parsed, resumptions=0), plugins={"inspect": Inspect}) as (app, server):
        events = post_stream(server.url, "/v1/chat/completions", CHAT)
        assert resumptions(app, "reset") == 0
    assert events[-1] == "[DONE]"
    errors = [e for e in events[:-1] if "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["type"] == "server_error"
    assert survivor.requests == []


@pytest.mark.parametrize("parsed", [False, True], ids=["bytes", "parsed"])
def test_no_resumption_without_another_healthy_worker(
    gateway_factory: GatewayFactory,
    doomed: FakeUpstream,
    survivor: FakeUpstream,
    upstream_url: str,
    survivor_server: tuple[FakeUpstream, ServerThread],
    parsed: bool,
) -> None:
    doomed.behavior.die_after = 5
    with gateway_factory(config([upstream_url], parsed=parsed), plugins={"inspect": Inspect}) as (_, server):
        alone = post_stream(server.url, "/v1/chat/completions", CHAT)
    survivor.healthy = False  # the other worker fails its health checks: out of rotation
    urls = [upstream_url, survivor_server[1].url]
    with gateway_factory(config(urls, parsed=parsed), plugins={"inspect": Inspect}) as (app, server):
        worker = app.state.services.workers.get(survivor_server[1].url)
        deadline = time.monotonic() + 10
        while worker.available() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not worker.available()
        unhealthy = post_stream(server.url, "/v1/chat/completions", CHAT)
    for events in (alone, unhealthy):
        assert events[-1] == "[DONE]"
        errors = [e for e in events[:-1] if "error" in e]
        assert len(errors) == 1 and errors[0]["error"]["type"] == "server_error"
    assert survivor.requests == []


@pytest.mark.parametrize(
    "extra",
    [
        {"n": 2},
        {"response_format": {"type": "json_object"}},
        {"prompt_logprobs": 1},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "required"},
    ],
    ids=["n2", "guided", "prompt_logprobs", "tool_choice_required"],
)
def test_requests_a_continuation_would_change_end_as_before(
    gateway_factory: GatewayFactory,
    doomed: FakeUpstream,
    survivor: FakeUpstream,
    urls: list[str],
    extra: dict[str, Any],
) -> None:
    doomed.behavior.die_after = 5
    with gateway_factory(config(urls, parsed=False), plugins={"inspect": Inspect}) as (_, server):
        events = post_stream(server.url, "/v1/chat/completions", {**CHAT, **extra})
    assert len([e for e in events[:-1] if "error" in e]) == 1
    assert survivor.requests == []


_TOOL_CALL = {"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}]}


@pytest.mark.parametrize(
    "delta",
    [_TOOL_CALL, {"reasoning": "Let me think"}, {"reasoning_content": "Let me think"}],
    ids=["tool-call", "reasoning", "reasoning_content"],
)
@pytest.mark.parametrize("parsed", [False, True], ids=["passthrough", "parsed"])
def test_tool_call_or_thinking_deltas_midstream_end_as_before(
    gateway_factory: GatewayFactory,
    survivor: FakeUpstream,
    survivor_server: tuple[FakeUpstream, ServerThread],
    delta: dict[str, Any],
    parsed: bool,
) -> None:
    """A stream already sending tool-call deltas, or a reasoning model's thinking (vLLM 0.32 writes
    ``reasoning``, earlier releases ``reasoning_content``), is not continued: neither the partial call nor
    the thinking can be handed back as an assistant prefill. One error event, as before."""
    events = _scripted_stream(gateway_factory, survivor_server[1].url, delta, parsed)
    assert len([e for e in events[:-1] if "error" in e]) == 1
    assert survivor.requests == []


def _scripted_stream(
    gateway_factory: GatewayFactory, survivor_url: str, delta: dict[str, Any], parsed: bool
) -> list[Any]:
    """A worker on a raw socket that sends a role chunk and one chunk with ``delta``, then drops the
    connection; the gateway relays it parsed or passed through."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    events = [
        {"id": "x", "created": 1, "model": "m1", "object": "chat.completion.chunk", "choices": [ch]}
        for ch in (
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None},
            {"index": 0, "delta": delta, "finish_reason": None},
        )
    ]
    body = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, rest = data.partition(b"\r\n\r\n")
            if head.startswith(b"GET"):
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n{}")
                conn.close()
                continue
            length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
            while len(rest) < length:
                rest += conn.recv(65536)
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                + b"%x\r\n%s\r\n" % (len(body), body)
            )
            time.sleep(0.1)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        urls = [f"http://127.0.0.1:{port}", survivor_url]
        with gateway_factory(config(urls, parsed=parsed), plugins={"inspect": Inspect}) as (_, server):
            tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
            return post_stream(server.url, "/v1/chat/completions", {**CHAT, "tools": tools})
    finally:
        listener.close()
        thread.join(timeout=5)


def test_a_resumed_answer_is_not_cached(
    gateway_factory: GatewayFactory,
    doomed: FakeUpstream,
    survivor: FakeUpstream,
    upstream_url: str,
    survivor_server: tuple[FakeUpstream, ServerThread],
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    doomed.behavior.die_after = 5
    cfg = cache_gateway_config(upstream_url, namespace)
    cfg["models"][0]["workers"] = [upstream_url, survivor_server[1].url]
    cfg["plugins"][-1] = {"name": "routing", "config": {"default": {"policy": "round_robin"}}}
    with gateway_factory(cfg, plugins=PLUGINS) as (app, server):
        events = post_stream(server.url, "/v1/chat/completions", {**CHAT, "temperature": 0})
        time.sleep(0.3)
        not_stored = app.state.services.metrics.registry.get_sample_value(
            "gateway_cache_not_stored_total", {"model": "m1", "reason": "resumed"}
        )
    assert text_of(events[:-1], True) == TEXT
    assert not [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(survivor.requests) == 1  # it was resumed
    assert not_stored == 1
    assert entry_names(redis_client, namespace) == []


@pytest.mark.parametrize("failure", ["die", "hang"])
def test_resumption_through_a_server_without_the_direct_writer(
    gateway_factory: GatewayFactory,
    doomed: FakeUpstream,
    survivor: FakeUpstream,
    urls: list[str],
    failure: str,
) -> None:
    """Under h11 the pass-through stream is sent as ASGI body pieces (``PassThrough.chunks``), not by the
    direct writer: it is continued the same way."""
    setattr(doomed.behavior, f"{failure}_after", 5)
    with gateway_factory(config(urls, parsed=False), plugins={"inspect": Inspect}, http="h11") as (_, server):
        events = post_stream(server.url, "/v1/chat/completions", {**CHAT, **USAGE})
    chunks = events[:-1]
    assert events[-1] == "[DONE]" and not [c for c in chunks if "error" in c]
    assert text_of(chunks, True) == TEXT
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["usage"]["completion_tokens"] == len(_pieces())
    assert len(survivor.requests) == 1
