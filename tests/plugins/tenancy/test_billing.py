"""What a tenant is charged, through the gateway against real Redis: the worst case is reserved on
admission (or max_tokens clamped to what is left), the charge is settled to what was delivered however
the request ended, and refusals and failures give the reservation back."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

import httpx
import orjson
import pytest
import redis.asyncio as aioredis

from gateway.pipeline import ModelResponse, Plugin, RequestContext
from gateway.wire.errors import InvalidRequest
from plugins.tenancy.keys import hash_key
from tests.server.test_audio_routes import AUDIO, AudioWorker
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.faults import SwitchableProxy
from tests.support.gateways import GatewayFactory, base_config
from tests.support.metrics import admin_metrics
from tests.support.safety import rules
from tests.support.tenancy import PEPPER, prefix

__all__ = ["prefix"]  # the fixture, used by name

KEY = "sk-gw-billing-test-key"
HEADERS = {"authorization": f"Bearer {KEY}"}
CONTEXT = 64  # the model's max_model_len in these tests
# "abcd" is 5 prompt tokens by the estimate and by the fake worker's usage.
MESSAGES = [{"role": "user", "content": "abcd"}]


def config(
    prefix: str, upstream_url: str, key_limits: dict[str, int], *, between: tuple[str, ...] = (), **section: Any
) -> dict[str, Any]:
    """Tenancy first, then the plugins ``between``, then routing (so their ``on_response`` runs before
    tenancy's, as the safety and cache plugins' do in the default order)."""
    keys = [{"id": "k1", "tenant": "t1", "hash": hash_key(KEY, PEPPER.encode()), "limits": key_limits}]
    plugins = [{"name": "tenancy", "config": {"redis_prefix": prefix, "keys": keys, **section}}]
    plugins += [{"name": name} for name in between] + [{"name": "routing"}]
    cfg = base_config([upstream_url], plugins=plugins)
    cfg["models"][0]["max_model_len"] = CONTEXT
    return cfg


def usage(server: ServerThread) -> dict[str, Any]:
    reply = httpx.post(
        server.url + "/admin/plugins/tenancy/usage", json={"key_id": "k1"}, headers={"authorization": "Bearer adm"}
    )
    assert reply.status_code == 200, reply.text
    return dict(reply.json()["result"]["day"])


def settled(server: ServerThread, done: Callable[[dict[str, Any]], bool], timeout_s: float = 15) -> dict[str, Any]:
    """The key's day usage once ``done`` holds for it (a charge after the reply is sent is settled a
    moment later, in the request's finalizer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        day = usage(server)
        if done(day) or time.monotonic() > deadline:
            return day
        time.sleep(0.05)


def chat(server: ServerThread, **extra: Any) -> httpx.Response:
    body = {"model": "m1", "messages": MESSAGES, **extra}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=30)


# -- the worst case on admission ------------------------------------------------------------------


def test_without_max_tokens_concurrent_requests_cannot_overspend_a_budget(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    """Each request may cost 5 + (64 - 5) = 64 tokens and does (the worker fills the context): a 1,000
    token budget admits at most 15 of 20 concurrent requests, and the charge never passes 1,000."""
    upstream.behavior.chunks = CONTEXT - 5  # the fake's usage: completion_tokens = chunks
    upstream.behavior.text = "t" * (CONTEXT - 5)
    with gateway_factory(config(prefix, upstream_url, {"tokens_per_day": 1000}), admin_token="adm") as (_, server):

        async def burst() -> list[int]:
            async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=20)) as client:
                body = {"model": "m1", "messages": MESSAGES}
                url = server.url + "/v1/chat/completions"
                replies = await asyncio.gather(*(client.post(url, json=body, headers=HEADERS) for _ in range(20)))
                return [r.status_code for r in replies]

        statuses = asyncio.run(burst())
        day = settled(server, lambda d: d["tokens"] == 64 * statuses.count(200))
    assert statuses.count(200) == 15 and statuses.count(429) == 5
    assert day["tokens"] == 64 * 15 <= 1000
    assert day["completion_tokens"] == 59 * 15


def test_n_choices_without_max_tokens_reserve_the_context_per_choice(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    with gateway_factory(config(prefix, upstream_url, {"tokens_per_minute": 300}), admin_token="adm") as (_, server):
        refused = chat(server, n=8)  # 5 + 8 x 59 = 477 > 300: can never fit
        fits = chat(server, n=4)  # 5 + 4 x 59 = 241
    assert refused.status_code == 429
    assert "Request too large for tokens per min (TPM)" in refused.json()["error"]["message"]
    assert "Requested 477" in refused.json()["error"]["message"]
    assert fits.status_code == 200
    assert len(upstream.requests) == 1 and "max_tokens" not in upstream.requests[0].body  # reserve mode


def test_a_completions_request_of_several_prompts_reserves_the_context_of_each(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    """A list of prompts is a batch: each prompt's completion may fill the context (5 x 64 tokens for
    five prompts of 1 token each), so a 200 token budget cannot admit it; one of those prompts fits."""
    upstream.behavior.chunks = 5 * (CONTEXT - 1)  # what five prompts can generate together
    upstream.behavior.text = "t" * upstream.behavior.chunks
    with gateway_factory(config(prefix, upstream_url, {"tokens_per_day": 200}), admin_token="adm") as (_, server):
        url = server.url + "/v1/completions"
        batch = httpx.post(url, json={"model": "m1", "prompt": ["abcd"] * 5}, headers=HEADERS, timeout=30)
        day = settled(server, lambda d: d["tokens"] == 0)
        upstream.behavior.chunks = CONTEXT - 1
        one = httpx.post(url, json={"model": "m1", "prompt": ["abcd"]}, headers=HEADERS, timeout=30)
    assert batch.status_code == 429 and batch.json()["error"]["code"] == "insufficient_quota"
    assert "this request needs about 320" in batch.json()["error"]["message"]
    assert day["tokens"] == 0 and len(upstream.requests) == 1
    assert one.status_code == 200


@pytest.mark.parametrize("extra", [{"max_tokens": 10**17}, {"max_completion_tokens": 2**64 - 1, "n": 128}])
def test_a_huge_max_tokens_or_n_is_reserved_not_a_redis_failure(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str, extra: dict[str, int]
) -> None:
    """Redis counts in integers below 2^63 and a script's numbers are doubles: a request's worst case is
    capped at 2^53 tokens, so a key without token limits is answered (vLLM clamps max_tokens to the
    context), not refused with a 503 as if Redis were down, and its usage is counted. (A token limit
    refuses such a request cleanly, as too large for it.)"""
    with gateway_factory(config(prefix, upstream_url, {}), admin_token="adm") as (_, server):
        reply = chat(server, **extra)
        day = settled(server, lambda d: d["tokens"] == 5 + 3)
    assert reply.status_code == 200, reply.text
    assert (day["requests"], day["tokens"]) == (1, 5 + 3)


def test_clamp_mode_sets_max_tokens_to_what_the_key_has_left(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    cfg = config(prefix, upstream_url, {"tokens_per_day": 120}, without_max_tokens="clamp")
    with gateway_factory(cfg, admin_token="adm") as (_, server):
        first = chat(server)  # 120 left: the whole context fits, max_tokens 59
        second = chat(server, n=2)  # 120 - 8 = 112 left: (112 - 5) // 2 = 53 per choice
        assert settled(server, lambda d: d["tokens"] == 16)["tokens"] == 16
        given = chat(server, max_tokens=200)  # a max_tokens of its own is never clamped: too large
    assert first.status_code == 200 and first.headers["x-gateway-max-tokens"] == "59"
    assert second.status_code == 200 and second.headers["x-gateway-max-tokens"] == "53"
    assert [seen.body.get("max_tokens") for seen in upstream.requests] == [59, 53]
    assert given.status_code == 429 and given.json()["error"]["code"] == "insufficient_quota"


def test_clamp_mode_shares_what_is_left_among_the_prompts_of_a_batch(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    """Each prompt of a completions batch gets max_tokens: 120 left, two prompts of 1 token (2 by the
    estimate) get (120 - 2) // 2 = 59 each, not 118 each."""
    cfg = config(prefix, upstream_url, {"tokens_per_day": 120}, without_max_tokens="clamp")
    with gateway_factory(cfg, admin_token="adm") as (_, server):
        body = {"model": "m1", "prompt": ["abcd", "abcd"]}
        reply = httpx.post(server.url + "/v1/completions", json=body, headers=HEADERS, timeout=30)
    assert reply.status_code == 200 and reply.headers["x-gateway-max-tokens"] == "59"
    assert upstream.requests[0].body["max_tokens"] == 59


def test_clamp_mode_refuses_when_not_one_token_per_choice_is_left(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    cfg = config(prefix, upstream_url, {"tokens_per_day": 13}, without_max_tokens="clamp")
    with gateway_factory(cfg, admin_token="adm") as (_, server):
        assert chat(server, max_tokens=3).status_code == 200  # 8 used, 5 left
        refused = chat(server)  # needs 5 + 1
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "insufficient_quota"
    assert "this request needs about 6" in refused.json()["error"]["message"]


# -- refusals and failures release ----------------------------------------------------------------


class RefuseAnswers(Plugin):
    """A later plugin (like an output filter) that refuses every answer after the worker produced it."""

    name = "refuse_answers"

    async def on_response(self, ctx: RequestContext, response: ModelResponse) -> ModelResponse | None:
        raise InvalidRequest("The answer was refused.", code="content_filter")


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_refused_by_a_later_plugin_is_not_charged(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str, stream: bool
) -> None:
    cfg = config(prefix, upstream_url, {"tokens_per_day": 1000}, between=("refuse_answers",))
    with gateway_factory(cfg, plugins={"refuse_answers": RefuseAnswers}, admin_token="adm") as (_, server):
        reply = chat(server, max_tokens=50, stream=stream)
        day = settled(server, lambda d: d["tokens"] < 55)
    if stream:  # the tokens were sent before the refusal (an error event instead of [DONE]): charged
        assert b"content_filter" in reply.content
        assert day["tokens"] == 5 + 3 and day["completion_tokens"] == 3
    else:
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "content_filter"
        assert day["tokens"] == 0 and day["requests"] == 1


class SilenceRedis(Plugin):
    """Listed after tenancy, so its ``on_response`` runs first: from the moment the answer is ready, the
    proxy between the gateway and Redis drops every byte, as a network path to Redis that goes silent."""

    name = "silence_redis"
    proxy: ClassVar[SwitchableProxy | None] = None

    async def on_response(self, ctx: RequestContext, response: ModelResponse) -> ModelResponse | None:
        assert self.proxy is not None
        self.proxy.blackholed.set()
        return None


def test_an_answer_does_not_wait_for_redis_to_answer_its_charge(
    gateway_factory: GatewayFactory, upstream_url: str, prefix: str
) -> None:
    """The charge is queued with the answer, which goes out without waiting for Redis's reply: with Redis
    silent from the moment the answer is ready, the client has it at once, not after tenancy's Redis
    timeout (4 s here), and the charge that got no reply is counted as a failed Redis call."""
    timeout_s = 4
    with SwitchableProxy(6379) as proxy:
        SilenceRedis.proxy = proxy
        cfg = config(
            prefix,
            upstream_url,
            {"tokens_per_day": 1000},
            between=("silence_redis",),
            redis_timeout_ms=timeout_s * 1000,
        )
        redis_url = f"redis://127.0.0.1:{proxy.port}"
        with gateway_factory(cfg, plugins={"silence_redis": SilenceRedis}, redis_url=redis_url) as (_, server):
            started = time.monotonic()
            reply = chat(server, max_tokens=5)
            answered_in = time.monotonic() - started
            failed = 'gateway_tenancy_redis_errors_total{op="charge"} 1.0'
            deadline = time.monotonic() + timeout_s + 10
            while failed not in admin_metrics(server) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert failed in admin_metrics(server)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] > 0
    assert answered_in < timeout_s / 2, answered_in  # not held until the charge timed out


class ForgetScripts(Plugin):
    """Listed after tenancy: once the answer is ready, Redis forgets its scripts (``SCRIPT FLUSH``, as a
    restarted Redis would), so tenancy's charge meets ``NOSCRIPT``."""

    name = "forget_scripts"

    async def on_response(self, ctx: RequestContext, response: ModelResponse) -> ModelResponse | None:
        client = aioredis.Redis()
        try:
            await client.script_flush()
        finally:
            await client.aclose()
        return None


def test_a_charge_redis_has_forgotten_the_script_of_is_loaded_and_run(
    gateway_factory: GatewayFactory, upstream_url: str, prefix: str
) -> None:
    """A charge sent without waiting for its reply still loads the script when Redis no longer knows it
    (flushed, restarted): the tokens are charged, and no Redis failure is counted."""
    cfg = config(prefix, upstream_url, {"tokens_per_day": 1000}, between=("forget_scripts",))
    with gateway_factory(cfg, plugins={"forget_scripts": ForgetScripts}, admin_token="adm") as (_, server):
        reply = chat(server, max_tokens=5)
        completion = reply.json()["usage"]["completion_tokens"]
        day = settled(server, lambda d: d["tokens"] == 5 + completion)
        metrics = admin_metrics(server)
    assert reply.status_code == 200
    assert (day["prompt_tokens"], day["completion_tokens"]) == (5, completion)
    assert "gateway_tenancy_redis_errors_total{" not in metrics


@pytest.mark.parametrize("status", [500, 502, 503])
def test_worker_failures_release_the_reservation(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str, status: int
) -> None:
    upstream.behavior.status = status
    with gateway_factory(config(prefix, upstream_url, {"tokens_per_day": 1000}), admin_token="adm") as (_, server):
        reply = chat(server)  # reserves 64
        day = settled(server, lambda d: d["tokens"] == 0)
        remaining = chat(server, max_tokens=1).headers.get("x-ratelimit-remaining-tokens")
    assert reply.status_code in (502, 503)
    assert day["tokens"] == 0 and day["requests"] == 1
    assert remaining is None  # only a budget, no per-minute bucket: no token headers


def test_a_failure_releases_the_per_minute_reservation_too(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    upstream.behavior.status = 503
    cfg = config(prefix, upstream_url, {"tokens_per_minute": 100})
    with gateway_factory(cfg, admin_token="adm") as (_, server):
        assert chat(server).status_code in (502, 503)  # reserved 64 of 100
        upstream.behavior.status = 200
        deadline = time.monotonic() + 15
        while True:  # the release lands in the finalizer, just after the reply
            reply = chat(server)  # 64 more: fits only once the first 64 are back
            if reply.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert reply.status_code == 200


# -- streams are charged for what was sent ---------------------------------------------------------


def test_a_stream_the_client_cuts_is_charged_for_what_was_sent(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    upstream.behavior.chunks = 50
    upstream.behavior.text = "w" * 50
    upstream.behavior.pace_s = 0.05
    with gateway_factory(config(prefix, upstream_url, {"tokens_per_day": 1000}), admin_token="adm") as (_, server):
        body = {"model": "m1", "messages": MESSAGES, "stream": True, "max_tokens": 50}
        read = 0
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=HEADERS) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: {") and orjson.loads(line[6:])["choices"][0]["delta"].get("content"):
                    read += 1
                    if read == 5:
                        break
        day = settled(server, lambda d: d["tokens"] < 55)
    assert read == 5
    assert day["prompt_tokens"] == 5
    assert 5 <= day["completion_tokens"] < 50  # what reached the client's connection, not the 50 asked for
    assert day["tokens"] == day["prompt_tokens"] + day["completion_tokens"]


def test_a_stream_the_worker_cuts_is_charged_for_what_was_sent(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    upstream.behavior.chunks = 10
    upstream.behavior.text = "w" * 10
    upstream.behavior.cut_after = 5  # the role event and 4 tokens, then the connection ends
    with gateway_factory(config(prefix, upstream_url, {"tokens_per_day": 1000}), admin_token="adm") as (_, server):
        reply = chat(server, stream=True, max_tokens=10)
        day = settled(server, lambda d: d["tokens"] < 15)
    assert b'"type":"server_error"' in reply.content  # the stream ends with an error event
    assert (day["prompt_tokens"], day["completion_tokens"], day["tokens"]) == (5, 4, 9)


def hang_up(
    server: ServerThread,
    reached: Callable[[], bool],
    body: dict[str, Any],
    *,
    read_first: bool = False,
    path: str = "/v1/chat/completions",
) -> None:
    """POST ``body`` to ``path`` as the billing key, wait until ``reached()`` (and, with ``read_first``,
    until the stream's first bytes came back), then close the connection without reading the answer."""
    raw = orjson.dumps(body)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            b"POST %s HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s" % (path.encode(), KEY.encode(), len(raw), raw)
        )
        if read_first:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        deadline = time.monotonic() + 15
        while not reached() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert reached(), "the request never got there"


class Stall(Plugin):
    """A plugin before routing that holds every request (as a full queue would), so none reaches a worker."""

    name = "stall"
    reached = threading.Event()

    async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
        type(self).reached.set()
        await asyncio.Event().wait()
        return None


def test_a_client_that_hangs_up_before_its_request_reached_a_worker_pays_nothing(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    Stall.reached.clear()
    cfg = config(prefix, upstream_url, {"tokens_per_day": 1000}, between=("stall",))
    with gateway_factory(cfg, plugins={"stall": Stall}, admin_token="adm") as (_, server):
        hang_up(server, Stall.reached.is_set, {"model": "m1", "messages": MESSAGES, "max_tokens": 50})
        day = settled(server, lambda d: d["tokens"] < 55)  # the reservation is released
    assert not upstream.requests
    assert (day["tokens"], day["requests"]) == (0, 1)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 50}),
        ("/v1/messages", {"messages": MESSAGES, "max_tokens": 50}),
        ("/v1/responses", {"input": "abcd", "max_output_tokens": 50, "store": False}),
    ],
)
def test_a_client_that_hangs_up_while_the_worker_generates_pays_the_prompt(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    path: str,
    body: dict[str, Any],
) -> None:
    """A non-streamed request's answer comes when its generation is over: a client that hangs up just
    before it got the worker's prefill (and its generation so far) for nothing, over and over."""
    upstream.behavior.hang = True  # generating until the gateway closes the connection
    with gateway_factory(config(prefix, upstream_url, {"tokens_per_day": 1000}), admin_token="adm") as (_, server):
        hang_up(server, lambda: bool(upstream.requests), {"model": "m1", **body}, path=path)
        day = settled(server, lambda d: d["tokens"] == 5)
    assert (day["prompt_tokens"], day["completion_tokens"], day["tokens"]) == (5, 0, 5)
    assert day["requests"] == 1


def test_a_client_that_hangs_up_before_the_first_token_pays_the_prompt(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    upstream.behavior.hang_after = 1  # the role event, then nothing until the gateway goes away
    with gateway_factory(config(prefix, upstream_url, {"tokens_per_day": 1000}), admin_token="adm") as (_, server):
        body = {"model": "m1", "messages": MESSAGES, "max_tokens": 50, "stream": True}
        hang_up(server, lambda: bool(upstream.requests), body, read_first=True)
        day = settled(server, lambda d: d["tokens"] == 5)
    assert (day["prompt_tokens"], day["completion_tokens"], day["tokens"]) == (5, 0, 5)


def test_a_stream_the_worker_cuts_before_its_first_token_is_not_charged(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    upstream.behavior.cut_after = 1  # the role event, then the connection ends
    with gateway_factory(config(prefix, upstream_url, {"tokens_per_day": 1000}), admin_token="adm") as (_, server):
        reply = chat(server, stream=True, max_tokens=10)
        day = settled(server, lambda d: d["tokens"] < 15)
    assert b'"type":"server_error"' in reply.content
    assert (day["tokens"], day["requests"]) == (0, 1)


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_completed_stream_is_charged_before_done(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str, include_usage: bool
) -> None:
    """Its charge is settled before [DONE] goes out: the client's next request sees it at once."""
    upstream.behavior.chunks = 7
    upstream.behavior.text = "w" * 7
    with gateway_factory(config(prefix, upstream_url, {"tokens_per_day": 1000}), admin_token="adm") as (_, server):
        extra: dict[str, Any] = {"stream_options": {"include_usage": True}} if include_usage else {}
        reply = chat(server, stream=True, max_tokens=20, **extra)
        day = usage(server)
    assert reply.content.endswith(b"data: [DONE]\n\n")
    assert (day["prompt_tokens"], day["completion_tokens"], day["tokens"]) == (5, 7, 12)


def test_a_transcription_is_charged_its_text_and_reserves_the_context(
    gateway_factory: GatewayFactory, upstream_url: str, prefix: str
) -> None:
    """vLLM's speech-to-text answer has no token usage (only the audio's seconds): it is charged its
    text's estimate, and, generating tokens, it reserves the context on admission like a chat request."""
    worker = AudioWorker(served=True)
    with ServerThread(worker) as speech:
        cfg = config(prefix, upstream_url, {"tokens_per_minute": 1000, "tokens_per_day": 1000})
        cfg["models"].append({"name": "whisper", "workers": [speech.url], "max_model_len": 448})
        with gateway_factory(cfg, admin_token="adm") as (_, server):
            url = server.url + "/v1/audio/transcriptions"
            files = {"file": ("clip.wav", AUDIO, "audio/wav")}
            reply = httpx.post(url, data={"model": "whisper", "prompt": "abcd"}, files=files, headers=HEADERS)
            day = settled(server, lambda d: d["completion_tokens"] > 0)
    text = reply.json()["text"]
    assert reply.status_code == 200 and text == f"heard {len(AUDIO)} bytes"
    assert reply.headers["x-ratelimit-remaining-tokens"] == str(1000 - 448)  # 1 + (448 - 1) reserved
    assert (day["prompt_tokens"], day["completion_tokens"]) == (1, -(-len(text) // 4))
    assert day["tokens"] == day["prompt_tokens"] + day["completion_tokens"]


# -- OpenAI's rate-limit headers -------------------------------------------------------------------

NAMES = [f"x-ratelimit-{part}-{kind}" for kind in ("requests", "tokens") for part in ("limit", "remaining", "reset")]


def test_rate_limit_headers_on_answers_streams_and_429s(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    limits = {"requests_per_minute": 3, "tokens_per_minute": 200, "tokens_per_day": 10_000}
    with gateway_factory(config(prefix, upstream_url, limits), admin_token="adm") as (_, server):
        answer = chat(server, max_tokens=3)
        stream = chat(server, max_tokens=3, stream=True)
        too_large = chat(server)  # 64 fits the tokens; then the third request of the minute
        over = chat(server, max_tokens=3)
    assert answer.status_code == 200 and [n for n in NAMES if n in answer.headers] == NAMES
    assert answer.headers["x-ratelimit-remaining-requests"] == "2"
    assert answer.headers["x-ratelimit-remaining-tokens"] == "192"  # 200 - (5 + 3) reserved
    assert stream.status_code == 200 and [n for n in NAMES if n in stream.headers] == NAMES
    assert stream.headers["x-ratelimit-remaining-requests"] == "1"
    assert too_large.status_code == 200 and too_large.headers["x-ratelimit-remaining-requests"] == "0"
    assert over.status_code == 429 and [n for n in NAMES if n in over.headers] == NAMES
    assert over.headers["x-ratelimit-remaining-requests"] == "0"
    assert int(over.headers["retry-after"]) >= 1


def test_the_reservation_covers_the_longest_context_a_fallback_or_canary_may_reach(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    cfg = config(prefix, upstream_url, {"tokens_per_minute": 500})
    cfg["models"].append({"name": "m2", "workers": [upstream_url], "max_model_len": 1024})
    with gateway_factory(cfg, admin_token="adm") as (_, server):
        alone = chat(server)  # m1 alone: 64 of context
    cfg["plugins"][-1] = {"name": "routing", "config": {"models": {"m1": {"fallbacks": ["m2"]}}}}
    with gateway_factory(cfg, admin_token="adm") as (_, server):
        reaching = chat(server)  # it may end up on m2: 5 + (1024 - 5) > 500
    assert alone.status_code == 200
    assert reaching.status_code == 429 and "Requested 1024" in reaching.json()["error"]["message"]


def test_a_stream_whose_text_a_later_plugin_holds_back_is_charged_every_token(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    """Output safety holds text back and releases it merged into later chunks: the charge still counts
    the worker's tokens, not the (fewer) chunks the client got."""
    upstream.behavior.chunks = 12
    upstream.behavior.text = "A perfectly harmless answer of twelve pieces."
    cfg = config(prefix, upstream_url, {"tokens_per_day": 1000})
    safety = {"rules": rules("block", ["output"]), "output": {"hold_back_chars": 64}}
    cfg["plugins"].insert(1, {"name": "safety", "config": safety})
    with gateway_factory(cfg, admin_token="adm") as (_, server):
        reply = chat(server, stream=True, max_tokens=20)
        day = usage(server)
    sent_events = reply.content.count(b'"content":"') - reply.content.count(b'"content":""')
    assert reply.content.endswith(b"data: [DONE]\n\n") and sent_events < 12  # merged by the hold-back
    assert (day["prompt_tokens"], day["completion_tokens"]) == (5, 12)
