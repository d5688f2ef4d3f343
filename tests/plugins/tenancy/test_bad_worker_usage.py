"""A worker's ``usage`` is believed only when its counts are non-negative integers up to 2^52: a faulty
or hostile worker that answers negative (or non-integer) counts is not a credit to the tenant, nor are
implausibly large ones a debt. The request's estimate
(the prompt estimate, and the answer's text or the stream's token events) is charged instead, once,
whether the answer is JSON or a stream. A scripted worker sends the exact bytes, against real Redis."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.pipeline import Plugin, RequestContext
from tests.plugins.tenancy.test_billing import HEADERS, MESSAGES, config, settled, usage
from tests.support.fakes import ServerThread
from tests.support.gateways import GatewayFactory
from tests.support.scripted_worker import ScriptedWorker, chunk, completion
from tests.support.tenancy import prefix

__all__ = ["prefix"]  # the fixture, used by name

PROMPT_ESTIMATE = 5  # "abcd" in one message: 1 token of text and 4 of the template
BAD_USAGES = {
    "negative": {"prompt_tokens": -1_000_000, "completion_tokens": -1_000_011, "total_tokens": -2_000_011},
    "negative-completion": {"prompt_tokens": 5, "completion_tokens": -1_000_000, "total_tokens": -999_995},
    "boolean": {"prompt_tokens": True, "completion_tokens": True, "total_tokens": 2},
    "fractional": {"prompt_tokens": 2.5, "completion_tokens": 0.5, "total_tokens": 3.0},
    "text": {"prompt_tokens": "5", "completion_tokens": "9", "total_tokens": "14"},
    # past 2^52 (MAX_COUNT: no request reaches it): a budget would be spent for good (a completion past
    # max_tokens is capped by the core first: see the test below for one without max_tokens)
    "huge": {"prompt_tokens": 2**52 + 1, "completion_tokens": 2, "total_tokens": 2**52 + 3},
}


@pytest.fixture
def scripted(gateway_factory: GatewayFactory, prefix: str) -> Iterator[tuple[ScriptedWorker, ServerThread]]:
    worker = ScriptedWorker()
    with ServerThread(worker) as upstream:
        cfg = config(prefix, upstream.url, {"tokens_per_day": 1000})
        with gateway_factory(cfg, admin_token="adm") as (_, gateway):
            yield worker, gateway


class ReadChunks(Plugin):
    """Reads every chunk as it comes: the request's streams take the parsed relay."""

    name = "read_chunks"

    async def on_chunk(self, ctx: RequestContext, chunk: dict[str, Any]) -> dict[str, Any] | None:
        return chunk


@pytest.fixture(params=["pass-through", "parsed"])
def on_either_path(
    request: pytest.FixtureRequest, gateway_factory: GatewayFactory, prefix: str
) -> Iterator[tuple[ScriptedWorker, ServerThread]]:
    """``scripted``, its streams relayed as bytes or parsed event by event."""
    parsed = request.param == "parsed"
    worker = ScriptedWorker()
    with ServerThread(worker) as upstream:
        cfg = config(prefix, upstream.url, {"tokens_per_day": 1000}, between=("read_chunks",) if parsed else ())
        plugins: dict[str, type[Plugin]] = {"read_chunks": ReadChunks} if parsed else {}
        with gateway_factory(cfg, plugins=plugins, admin_token="adm") as (_, gateway):
            yield worker, gateway


def _charged(gateway: ServerThread, *, stream: bool, max_tokens: int | None = 16, **extra: Any) -> dict[str, Any]:
    body = {"model": "m1", "messages": MESSAGES, "max_tokens": max_tokens, "stream": stream, **extra}
    reply = httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=30)
    assert reply.status_code == 200, reply.text
    if stream:
        assert reply.text.rstrip().endswith("data: [DONE]")
    # Settled once the 16 tokens reserved beyond the estimate are given back.
    return settled(gateway, lambda d: d["requests"] == 1 and d["tokens"] < PROMPT_ESTIMATE + 16)


@pytest.mark.parametrize("bad", BAD_USAGES.values(), ids=BAD_USAGES.keys())
def test_an_answers_bad_usage_is_ignored_and_its_estimate_charged(
    scripted: tuple[ScriptedWorker, ServerThread], bad: dict[str, Any]
) -> None:
    worker, gateway = scripted
    worker.body = completion(usage=bad)  # "Hello": 2 tokens by its text
    day = _charged(gateway, stream=False)
    assert (day["prompt_tokens"], day["completion_tokens"], day["tokens"]) == (PROMPT_ESTIMATE, 2, PROMPT_ESTIMATE + 2)


@pytest.mark.parametrize("bad", BAD_USAGES.values(), ids=BAD_USAGES.keys())
def test_a_streams_bad_usage_is_ignored_and_its_estimate_charged(
    scripted: tuple[ScriptedWorker, ServerThread], bad: dict[str, Any]
) -> None:
    worker, gateway = scripted
    worker.events = [
        chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}),
        chunk({"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}),
        chunk({"index": 0, "delta": {"content": "lo"}, "finish_reason": None}),
        chunk({"index": 0, "delta": {}, "finish_reason": "stop"}),
        chunk(None, usage=bad),
        b"[DONE]",
    ]
    day = _charged(gateway, stream=True)
    # The two events that carried text are the completion's tokens.
    assert (day["prompt_tokens"], day["completion_tokens"], day["tokens"]) == (PROMPT_ESTIMATE, 2, PROMPT_ESTIMATE + 2)


@pytest.mark.parametrize("completion_tokens", [2**52 + 1, 2**53 + 1, 2**63])
@pytest.mark.parametrize("stream", [False, True])
def test_a_completion_count_past_max_count_is_ignored_without_max_tokens(
    scripted: tuple[ScriptedWorker, ServerThread], completion_tokens: int, stream: bool
) -> None:
    """Without max_tokens nothing caps the answer's count first: 2^63 failed the charge script (the
    request was then charged nothing), 2^53 + 1 spent the day's budget for good. The text (or the stream's
    events that carried output) is charged instead."""
    worker, gateway = scripted
    bad = {"prompt_tokens": 5, "completion_tokens": completion_tokens, "total_tokens": completion_tokens + 5}
    worker.body = completion(usage=bad)
    worker.events = [
        chunk({"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "finish_reason": None}),
        chunk({"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}),
        chunk(None, usage=bad),
        b"[DONE]",
    ]
    day = _charged(gateway, stream=stream, max_tokens=None)
    assert (day["prompt_tokens"], day["completion_tokens"], day["tokens"]) == (PROMPT_ESTIMATE, 2, PROMPT_ESTIMATE + 2)


def test_a_budget_is_never_credited_by_negative_usage(scripted: tuple[ScriptedWorker, ServerThread]) -> None:
    """Ten answers claiming -2,000,011 tokens each leave the day's budget spent by their estimates, and
    used only upward: no request ever makes room for more."""
    worker, gateway = scripted
    worker.body = completion(usage=BAD_USAGES["negative"])
    seen = []
    for done in range(1, 11):
        body = {"model": "m1", "messages": MESSAGES, "max_tokens": 16}
        reply = httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=30)
        assert reply.status_code == 200, reply.text
        seen.append(settled(gateway, lambda d, n=done: d["requests"] == n and d["tokens"] <= 7 * n)["tokens"])
    assert seen == [7 * n for n in range(1, 11)]
    assert usage(gateway)["tokens"] == 70


@pytest.mark.parametrize("max_tokens", [None, 16])
def test_an_answers_completion_count_past_what_its_text_holds_is_ignored(
    scripted: tuple[ScriptedWorker, ServerThread], max_tokens: int | None
) -> None:
    """10^9 completion tokens in "Hello" (below MAX_COUNT) is no count: its text is charged, not 10^9
    (a budget spent for good), nor the whole max_tokens."""
    worker, gateway = scripted
    worker.body = completion(usage={"prompt_tokens": 5, "completion_tokens": 10**9, "total_tokens": 10**9 + 5})
    day = _charged(gateway, stream=False, max_tokens=max_tokens)
    assert (day["prompt_tokens"], day["completion_tokens"], day["tokens"]) == (PROMPT_ESTIMATE, 2, PROMPT_ESTIMATE + 2)


def _hello_stream(usage: dict[str, Any]) -> list[bytes]:
    """ "Hello" in two events that carry text, then ``usage``."""
    return [
        chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}),
        chunk({"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}),
        chunk({"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}),
        chunk(None, usage=usage),
        b"[DONE]",
    ]


@pytest.mark.parametrize("max_tokens", [None, 16])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_streams_completion_count_past_what_its_events_hold_is_ignored(
    on_either_path: tuple[ScriptedWorker, ServerThread], include_usage: bool, max_tokens: int | None
) -> None:
    """10^9 completion tokens in a stream of "Hello" (below MAX_COUNT) is no count, as in an answer: the
    events that carried text are charged (a budget of 1,000 was charged 1,000,000,005), with the prompt
    estimate. The client that asked for the usage event still gets it as the worker sent it."""
    worker, gateway = on_either_path
    worker.events = _hello_stream({"prompt_tokens": 5, "completion_tokens": 10**9, "total_tokens": 10**9 + 5})
    extra = {"stream_options": {"include_usage": True}} if include_usage else {}
    day = _charged(gateway, stream=True, max_tokens=max_tokens, **extra)
    assert (day["prompt_tokens"], day["completion_tokens"], day["tokens"]) == (PROMPT_ESTIMATE, 2, PROMPT_ESTIMATE + 2)


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_streams_count_its_events_can_hold_is_charged_as_reported(
    on_either_path: tuple[ScriptedWorker, ServerThread], include_usage: bool
) -> None:
    """A worker may send several tokens in one event (5 tokens in the two events of "Hello"): a count its
    events can hold is the worker's, charged as it says, prompt included."""
    worker, gateway = on_either_path
    worker.events = _hello_stream({"prompt_tokens": 6, "completion_tokens": 5, "total_tokens": 11})
    extra = {"stream_options": {"include_usage": True}} if include_usage else {}
    day = _charged(gateway, stream=True, max_tokens=None, **extra)
    assert (day["prompt_tokens"], day["completion_tokens"], day["tokens"]) == (6, 5, 11)
