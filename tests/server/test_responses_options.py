"""The Responses options the engine accepts, through the gateway on the fake worker with the real Redis,
driven by the official ``openai`` SDK: ``reasoning.effort`` and ``text.verbosity`` reach the worker as
chat's ``reasoning_effort`` / ``verbosity``, ``include`` logprobs come back on the output text (whole and
streamed), ``max_tool_calls`` and ``prompt_cache_retention`` are accepted and echoed, ``truncation:
"auto"`` drops the oldest turns to fit the worker's context and says so; what stays refused names the
field. Every Response and event is checked against OpenAI's OpenAPI schema."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory
from tests.support.responses import responses_gateway
from tests.support.responses_schema import check_event, check_response


@pytest.fixture
def server(gateway_factory: GatewayFactory, upstream_url: str) -> Iterator[ServerThread]:
    with responses_gateway(gateway_factory, upstream_url) as srv:
        yield srv


def sdk(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def last_chat(upstream: FakeUpstream) -> dict[str, Any]:
    return [r for r in upstream.requests if r.path == "/v1/chat/completions"][-1].body


def test_reasoning_effort_and_verbosity_reach_the_worker(server: ServerThread, upstream: FakeUpstream) -> None:
    response = sdk(server).responses.create(
        model="m1", input="hi", reasoning={"effort": "low"}, text={"verbosity": "high"}
    )
    chat = last_chat(upstream)
    assert chat["reasoning_effort"] == "low" and chat["verbosity"] == "high"
    assert response.reasoning is not None and response.reasoning.effort == "low"
    assert response.text is not None and response.text.verbosity == "high"
    check_response(response.model_dump(mode="json", exclude_unset=True))
    plain = sdk(server).responses.create(model="m1", input="hi")
    assert "reasoning_effort" not in last_chat(upstream) and "verbosity" not in last_chat(upstream)
    assert plain.text is not None and plain.text.verbosity == "medium"


def test_logprobs_come_back_on_the_output_text(server: ServerThread, upstream: FakeUpstream) -> None:
    client = sdk(server)
    response = client.responses.create(model="m1", input="hi", include=["message.output_text.logprobs"], top_logprobs=2)
    chat = last_chat(upstream)
    assert chat["logprobs"] is True and chat["top_logprobs"] == 2
    part = response.output[0].content[0]  # type: ignore[union-attr]
    assert part.logprobs is not None and "".join(lp.token for lp in part.logprobs) == part.text  # type: ignore[union-attr]
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)  # type: ignore[union-attr]
    assert response.top_logprobs == 2
    check_response(httpx.get(f"{server.url}/v1/responses/{response.id}").json())

    body = {"model": "m1", "input": "hi", "include": ["message.output_text.logprobs"], "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=10) as reply:
        events = [orjson.loads(line[6:]) for line in reply.read().split(b"\n") if line.startswith(b"data: ")]
    for event in events:
        check_event(event)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and all(len(e["logprobs"]) == 1 and e["logprobs"][0]["token"] == e["delta"] for e in deltas)
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert [lp["token"] for lp in done["logprobs"]] == [e["delta"] for e in deltas]
    # without include, nothing is asked of the worker
    client.responses.create(model="m1", input="hi")
    assert "logprobs" not in last_chat(upstream)


def test_max_tool_calls_and_prompt_cache_retention_are_accepted_and_echoed(
    server: ServerThread, upstream: FakeUpstream
) -> None:
    response = sdk(server).responses.create(model="m1", input="hi", max_tool_calls=3, prompt_cache_retention="24h")
    assert response.max_tool_calls == 3 and response.prompt_cache_retention == "24h"
    chat = last_chat(upstream)
    assert "max_tool_calls" not in chat and "prompt_cache_retention" not in chat
    check_response(response.model_dump(mode="json", exclude_unset=True))


def test_truncation_auto_drops_the_oldest_turns_to_fit_and_says_so(
    server: ServerThread, upstream: FakeUpstream
) -> None:
    upstream.behavior.tokenize = "chars"  # one token per character, in a 500-token context
    upstream.behavior.max_model_len = 500
    client = sdk(server)
    previous = None
    for turn in range(6):
        previous = client.responses.create(
            model="m1", input=f"turn {turn} " + "z" * 90, previous_response_id=previous.id if previous else None
        )
    assert previous is not None
    raw = client.responses.with_raw_response.create(
        model="m1", input="the last question", previous_response_id=previous.id, truncation="auto",
        max_output_tokens=50,
    )  # fmt: skip
    fitted = raw.parse()
    messages = last_chat(upstream)["messages"]
    assert sum(len(m["content"]) for m in messages) + 50 <= 500
    dropped = int(raw.headers["x-gateway-truncated-items"])
    assert dropped > 0 and dropped % 2 == 0 and len(messages) == 13 - dropped  # whole turns, oldest first
    assert messages[0]["role"] == "user" and messages[-1]["content"] == "the last question"
    assert fitted.truncation == "auto"
    # the store keeps every turn: truncation is about what the worker reads, never about history
    listed = client.responses.input_items.list(fitted.id, limit=100).data
    assert len(listed) == 13
    # disabled (the default): the whole conversation goes, and the worker decides
    raw = client.responses.with_raw_response.create(model="m1", input="again", previous_response_id=previous.id)
    assert len(last_chat(upstream)["messages"]) == 13 and "x-gateway-truncated-items" not in raw.headers


def test_truncation_auto_fits_a_conversation_far_longer_than_the_context(
    server: ServerThread, upstream: FakeUpstream
) -> None:
    """A conversation of which only the newest few of 80 turns fit is still fitted, with a handful of
    counts (not one /tokenize call per dropped turn)."""
    upstream.behavior.tokenize = "chars"
    upstream.behavior.max_model_len = 500
    client = sdk(server)
    previous = None
    for turn in range(80):
        previous = client.responses.create(
            model="m1", input=f"turn {turn} zzzzz", previous_response_id=previous.id if previous else None
        )
    assert previous is not None
    counts = len(upstream.tokenized)
    raw = client.responses.with_raw_response.create(
        model="m1", input="the last question", previous_response_id=previous.id, truncation="auto",
        max_output_tokens=50,
    )  # fmt: skip
    messages = last_chat(upstream)["messages"]
    assert sum(len(m["content"]) for m in messages) + 50 <= 500
    dropped = int(raw.headers["x-gateway-truncated-items"])
    assert dropped > 128 and len(messages) == 161 - dropped  # more than 64 turns left out
    assert messages[0]["role"] == "user" and messages[-1]["content"] == "the last question"
    # the newest turns that fit, no fewer: one more (a user and an assistant message) would not
    assert sum(len(m["content"]) for m in messages) + len("turn 10 zzzzz") + len(upstream.behavior.text) + 50 > 500
    assert len(upstream.tokenized) - counts <= 12


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"text": {"verbosity": "loud"}}, "text.verbosity"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"max_tool_calls": 0}, "max_tool_calls"),
        ({"truncation": "middle"}, "truncation"),
        ({"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
    ],
)
def test_what_stays_refused_names_the_field(
    server: ServerThread, upstream: FakeUpstream, extra: dict[str, Any], param: str
) -> None:
    reply = httpx.post(server.url + "/v1/responses", json={"model": "m1", "input": "hi", **extra})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    assert not [r for r in upstream.requests if r.path == "/v1/chat/completions"]
