"""Output rules: completions checked non-stream (on_response) and streamed (bounded hold-back)."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from plugins.safety import OutputSafetyPlugin, SafetyConfig, SafetyPlugin
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.support.safety import SAMPLES, chat, finish_reasons, rules, safety, services, stream_events, streamed_text

KINDS = list(SAMPLES)
BEFORE = "Sure, here it is. "
AFTER = " That is everything I know about it, in detail."


@pytest.fixture
def output_gateway(gateway_factory: GatewayFactory, upstream_url: str) -> Iterator[Any]:
    stack: list[Any] = []

    def make(action: str, hold_back: int = 64) -> ServerThread:
        config = {"rules": rules(action, ["output"]), "output": {"hold_back_chars": hold_back}}
        cm = gateway_factory(base_config([upstream_url], plugins=safety(config)))
        stack.append(cm)
        return cm.__enter__()[1]

    yield make
    for cm in reversed(stack):
        cm.__exit__(None, None, None)


def test_the_class_is_chosen_by_whether_output_rules_exist() -> None:
    input_only = SafetyConfig.model_validate({"rules": rules("block")})
    with_output = SafetyConfig.model_validate({"rules": rules("block", ["input", "output"])})
    assert type(SafetyPlugin(input_only, services())) is SafetyPlugin
    assert type(SafetyPlugin(with_output, services())) is OutputSafetyPlugin
    # The core passes stream bytes through untouched unless a plugin class overrides these hooks.
    assert not SafetyPlugin.overrides("on_chunk") and not SafetyPlugin.overrides("on_response")
    assert OutputSafetyPlugin.overrides("on_chunk") and OutputSafetyPlugin.overrides("on_response")


@pytest.mark.parametrize("kind", KINDS)
def test_non_stream_block_cuts_the_completion(output_gateway: Any, upstream: FakeUpstream, kind: str) -> None:
    server = output_gateway("block")
    sample = SAMPLES[kind][1]
    upstream.behavior.text = BEFORE + sample + AFTER
    response = chat(server, "tell me")
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "content_filter"
    assert choice["message"]["content"] == BEFORE
    assert sample not in response.text


@pytest.mark.parametrize("kind", KINDS)
def test_non_stream_redact_and_log(
    output_gateway: Any, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    _, sample, placeholder = SAMPLES[kind]
    upstream.behavior.text = BEFORE + sample + AFTER
    redacted = chat(output_gateway("redact"), "tell me").json()["choices"][0]
    assert redacted["message"]["content"] == BEFORE + placeholder + AFTER
    assert redacted["finish_reason"] == "stop"
    with caplog.at_level(logging.INFO, logger="gateway.safety"):
        logged = chat(output_gateway("log"), "tell me").json()["choices"][0]
    assert logged["message"]["content"] == BEFORE + sample + AFTER
    lines = [r.fields for r in caplog.records if r.name == "gateway.safety" and hasattr(r, "fields")]
    assert any(f["rule"] == f"r-{kind}" and f["direction"] == "output" for f in lines), lines
    assert hashlib.sha256(sample.encode()).hexdigest() not in caplog.text


@pytest.mark.parametrize("chunks", [1, 7, 40])
@pytest.mark.parametrize("kind", KINDS)
def test_stream_block_never_sends_the_match(
    output_gateway: Any, upstream: FakeUpstream, kind: str, chunks: int
) -> None:
    """However the worker splits the text, no part of the match reaches the client."""
    server = output_gateway("block")
    sample = SAMPLES[kind][1]
    upstream.behavior.text = BEFORE + sample + AFTER
    upstream.behavior.chunks = chunks
    events = stream_events(server, "tell me")
    assert streamed_text(events) == BEFORE
    assert finish_reasons(events) == ["content_filter"]
    assert events[-1] == "[DONE]"


@pytest.mark.parametrize("kind", KINDS)
def test_stream_redact_and_log(output_gateway: Any, upstream: FakeUpstream, kind: str) -> None:
    _, sample, placeholder = SAMPLES[kind]
    upstream.behavior.text = BEFORE + sample + AFTER
    upstream.behavior.chunks = 25
    events = stream_events(output_gateway("redact"), "tell me")
    assert streamed_text(events) == BEFORE + placeholder + AFTER
    assert finish_reasons(events) == ["stop"]
    events = stream_events(output_gateway("log"), "tell me")
    assert streamed_text(events) == BEFORE + sample + AFTER


def test_clean_stream_releases_held_text_with_the_last_chunk(output_gateway: Any, upstream: FakeUpstream) -> None:
    text = "A perfectly ordinary answer about gardening and tomatoes. " * 4
    upstream.behavior.text = text
    upstream.behavior.chunks = 30
    events = stream_events(output_gateway("block", hold_back=32), "tell me", stream_options={"include_usage": True})
    assert streamed_text(events) == text
    finals = [e for e in events if isinstance(e, dict) and any(c.get("finish_reason") for c in e["choices"])]
    assert len(finals) == 1 and finals[0]["choices"][0]["delta"].get("content")  # the held tail rides on it
    assert isinstance(events[-2], dict) and events[-2]["usage"]
    # Text flows before the end: the hold-back is bounded, not a buffer of the whole answer.
    contents = [
        c["delta"].get("content")
        for e in events
        if isinstance(e, dict)
        for c in e["choices"]
        if c.get("finish_reason") is None
    ]
    assert any(contents)


def test_legacy_completions_stream_block(output_gateway: Any, upstream: FakeUpstream) -> None:
    server = output_gateway("block")
    upstream.behavior.text = BEFORE + SAMPLES["email"][1] + AFTER
    upstream.behavior.chunks = 12
    body = {"model": "m1", "prompt": "tell me", "stream": True}
    raw = httpx.post(server.url + "/v1/completions", json=body, timeout=10).text
    payloads = [orjson.loads(b[6:]) for b in raw.split("\n\n") if b.startswith("data: {")]
    assert "".join(c["text"] for p in payloads for c in p["choices"]) == BEFORE
    assert payloads[-1]["choices"][0]["finish_reason"] == "content_filter"
