"""The gateway keeps the request's max_tokens whatever the worker does: a worker that runs past it
(faulty or hostile) has its stream ended at the limit with ``finish_reason: "length"``, on the byte
pass-through and on the parsed relay alike, and the tenant is charged no more than it asked for. A
count the answer's text cannot hold is no count: it cuts nothing, and the text is charged."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from gateway.pipeline.context import RequestContext
from gateway.pipeline.plugin import Plugin
from gateway.proxy.token_limit import cap_answer
from gateway.wire.completion_bound import MARKUP_PER_CALL, SPECIAL_PER_CHOICE
from plugins.tenancy.keys import hash_key
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory, base_config
from tests.support.tenancy import PEPPER, prefix

__all__ = ["prefix"]  # the fixture, used by name

KEY = "sk-gw-max-tokens-kept"


class Watcher(Plugin):
    """Reads every chunk as it comes: the request's streams take the parsed relay."""

    name = "watcher"

    async def on_chunk(self, ctx: RequestContext, chunk: dict[str, Any]) -> dict[str, Any] | None:
        return chunk


PLUGINS = {"watcher": Watcher}


def config(upstream_url: str, prefix: str, *, parsed: bool, **extra: Any) -> dict[str, Any]:
    key = {"id": "k1", "tenant": "t1", "hash": hash_key(KEY, PEPPER.encode()), "limits": {"tokens_per_day": 10_000}}
    plugins: list[dict[str, Any]] = [{"name": "tenancy", "config": {"redis_prefix": prefix, "keys": [key]}}]
    if parsed:
        plugins.append({"name": "watcher"})
    return base_config([upstream_url], plugins=[*plugins, {"name": "routing"}], **extra)


def stream(server_url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server_url + "/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status_code == 200
        raw = response.read()
    assert raw.endswith(b"data: [DONE]\n\n")
    events = [line[6:] for line in raw.split(b"\n\n") if line.startswith(b"data: {")]
    return [orjson.loads(e) for e in events]


def day(server_url: str) -> dict[str, Any]:
    reply = httpx.post(
        server_url + "/admin/plugins/tenancy/usage", json={"key_id": "k1"}, headers={"authorization": "Bearer adm"}
    )
    return dict(reply.json()["result"]["day"])


@pytest.mark.parametrize("parsed", [False, True], ids=["pass-through", "parsed"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_stream_past_max_tokens_is_ended_at_the_limit_and_charged_no_more(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    parsed: bool,
    include_usage: bool,
) -> None:
    upstream.behavior.ignore_max_tokens = True
    upstream.behavior.chunks = 20  # the worker sends 20 tokens whatever the request says
    body: dict[str, Any] = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    body |= {"max_tokens": 5, "temperature": 0.7}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    with gateway_factory(config(upstream_url, prefix, parsed=parsed), plugins=PLUGINS, admin_token="adm") as (
        _,
        server,
    ):
        events = stream(server.url, body)
        charged = day(server.url)
    texts = [c["delta"].get("content") for e in events for c in e.get("choices", ()) if c["delta"].get("content")]
    finishes = [c["finish_reason"] for e in events for c in e.get("choices", ()) if c.get("finish_reason")]
    assert len(texts) == 5 and finishes == ["length"]
    assert charged["completion_tokens"] == 5


def test_a_worker_that_keeps_the_limit_is_untouched(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    upstream.behavior.chunks = 20
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 5}
    with gateway_factory(config(upstream_url, prefix, parsed=False), admin_token="adm") as (_, server):
        events = stream(server.url, body)
    finishes = [c["finish_reason"] for e in events for c in e.get("choices", ()) if c.get("finish_reason")]
    assert finishes == ["length"]
    assert all(e["id"] == events[0]["id"] for e in events)  # the worker's own events, none made up


def test_an_answer_past_max_tokens_is_charged_no_more(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    upstream.behavior.ignore_max_tokens = True
    upstream.behavior.chunks = 20  # the fake's usage: completion_tokens = chunks
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    with gateway_factory(config(upstream_url, prefix, parsed=False), admin_token="adm") as (_, server):
        reply = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"})
        charged = day(server.url)
    assert reply.status_code == 200
    assert reply.json()["usage"]["completion_tokens"] == 5
    assert reply.json()["choices"][0]["finish_reason"] == "length"
    assert charged["completion_tokens"] == 5


def test_a_batch_of_prompts_gets_max_tokens_for_each_and_is_reserved_for_each(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    """A completions request with a list of prompts is one generation per prompt (vLLM's choices are
    prompts x n): max_tokens applies to each, so an answer of 3 tokens for each of 2 prompts is neither
    cut nor charged less than it cost."""
    upstream.behavior.chunks = 6  # the fake's usage: completion_tokens = chunks (3 per prompt)
    upstream.behavior.text = "abcdef"
    body = {"model": "m1", "prompt": ["hi", "ho"], "max_tokens": 3}
    with gateway_factory(config(upstream_url, prefix, parsed=False), admin_token="adm") as (_, server):
        reply = httpx.post(server.url + "/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"})
        charged = day(server.url)
    assert reply.status_code == 200
    assert reply.json()["usage"]["completion_tokens"] == 6
    assert reply.json()["choices"][0]["text"] == "abcdef" and reply.json()["choices"][0]["finish_reason"] != "length"
    assert charged["completion_tokens"] == 6


#: A chat request carrying a ``prompt`` list: an operator's extra field (``limits.extra_params``), which
#: vLLM's chat ignores. Only the legacy completions endpoint batches prompts.
STRAY_PROMPTS: dict[str, Any] = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "prompt": ["x"] * 1000}
EXTRA_PROMPT = {"extra_params": ["prompt"]}


@pytest.mark.parametrize("parsed", [False, True], ids=["pass-through", "parsed"])
def test_a_prompt_list_on_a_chat_stream_does_not_multiply_its_max_tokens(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str, parsed: bool
) -> None:
    """The chat stream is one choice: it gets max_tokens (not max_tokens x 1000), and the answer cut
    there ends that one choice (not 1000 choice indices)."""
    upstream.behavior.ignore_max_tokens = True
    upstream.behavior.text = "x" * 2_010
    upstream.behavior.chunks = 2_010  # the worker sends 2,010 tokens whatever the request says
    body = {**STRAY_PROMPTS, "stream": True, "max_tokens": 2}
    gateway = gateway_factory(
        config(upstream_url, prefix, parsed=parsed, limits=EXTRA_PROMPT), plugins=PLUGINS, admin_token="adm"
    )
    with gateway as (_, server):
        events = stream(server.url, body)
        charged = day(server.url)
    texts = [c["delta"].get("content") for e in events for c in e.get("choices", ()) if c["delta"].get("content")]
    finishes = [
        (c["index"], c["finish_reason"]) for e in events for c in e.get("choices", ()) if c.get("finish_reason")
    ]
    assert len(texts) == 2 and finishes == [(0, "length")]
    assert charged["completion_tokens"] == 2


def test_a_prompt_list_on_a_chat_request_is_reserved_as_one_prompt(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    """max_tokens 11 for one prompt fits the key's 10,000 tokens a day; 11 x 1000 prompts would not."""
    body = {**STRAY_PROMPTS, "max_tokens": 11}
    with gateway_factory(config(upstream_url, prefix, parsed=False, limits=EXTRA_PROMPT), admin_token="adm") as (
        _,
        server,
    ):
        reply = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"})
    assert reply.status_code == 200, reply.text


def test_an_unbelievable_count_past_max_tokens_cuts_nothing_and_the_text_is_charged(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    """10^9 completion tokens in a 27-character answer is no count: cut by it, the answer was emptied and
    charged the whole max_tokens. It goes out as the worker sent it, charged by its text (27 / 4)."""
    upstream.behavior.chunks = 10**9  # the fake's usage: completion_tokens = chunks
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    with gateway_factory(config(upstream_url, prefix, parsed=False), admin_token="adm") as (_, server):
        reply = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"})
        charged = day(server.url)
    assert reply.status_code == 200
    choice = reply.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("Hello from the fake worker.", "stop")
    assert reply.json()["usage"]["completion_tokens"] == 10**9  # the worker's, not made up
    assert charged["completion_tokens"] == 7


def _answer(completion: int, **message: Any) -> dict[str, Any]:
    choice = {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": "stop"}
    return {"choices": [choice], "usage": {"prompt_tokens": 3, "completion_tokens": completion}}


@pytest.mark.parametrize("completion", [10**9, 20 + SPECIAL_PER_CHOICE + 1])
def test_cap_answer_ignores_a_count_past_what_the_text_can_hold(completion: int) -> None:
    answer = _answer(completion, content="x" * 20)
    assert not cap_answer(answer, 5)
    assert answer == _answer(completion, content="x" * 20)


def test_cap_answer_cuts_by_a_count_the_output_can_hold() -> None:
    """The bound is the output's UTF-8 bytes (a 3-byte character may be 3 tokens), its reasoning and tool
    calls, and a few tokens per choice and call: a count up to it is believed, and cuts."""
    most = 3 * 10 + SPECIAL_PER_CHOICE
    answer = _answer(most, content="€" * 10)
    assert cap_answer(answer, most // 2)
    assert answer["choices"][0]["message"]["content"] == "€" * 5
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": most // 2, "total_tokens": 3 + most // 2}
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    with_call = _answer(most + 3 + MARKUP_PER_CALL + 4, content="€" * 10, reasoning_content="abcd", tool_calls=[call])
    assert cap_answer(with_call, 10) and with_call["choices"][0]["finish_reason"] == "length"
