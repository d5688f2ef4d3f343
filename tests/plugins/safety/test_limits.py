"""Per-model limits (400 naming the field), prompt tokens counted with a real tokenizer file, the
model-based classifier against a second fake worker, and config errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from gateway.pipeline.config import GatewayConfig
from plugins.safety import SafetyConfig, SafetyPlugin
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.support.safety import chat, safety, services, word_tokenizer

LIMITS = {
    "max_body_bytes": 4000,
    "max_messages": 3,
    "max_prompt_chars": 500,
    "max_tokens": 100,
    "max_n": 2,
    "max_tools": 1,
    "max_json_depth": 6,
}


def _tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}


OVER: dict[str, tuple[dict[str, Any], str, str]] = {
    # limit -> (request fields over it, param named, code)
    "max_body_bytes": ({"metadata": {"blob": "x" * 5000}}, "messages", "request_too_large"),
    "max_messages": ({"messages": [{"role": "user", "content": "hi"}] * 4}, "messages", "limit_exceeded"),
    "max_prompt_chars": ({"messages": [{"role": "user", "content": "y" * 501}]}, "messages", "limit_exceeded"),
    "max_tokens": ({"max_tokens": 101}, "max_tokens", "limit_exceeded"),
    "max_completion_tokens": ({"max_completion_tokens": 101}, "max_completion_tokens", "limit_exceeded"),
    "max_n": ({"n": 3}, "n", "limit_exceeded"),
    "max_tools": ({"tools": [_tool("a"), _tool("b")]}, "tools", "limit_exceeded"),
    "max_json_depth": (
        {"response_format": {"a": {"b": {"c": {"d": {"e": {}}}}}}},
        "response_format",
        "too_deeply_nested",
    ),
}


@pytest.fixture
def limited(gateway_factory: GatewayFactory, upstream_url: str) -> Iterator[ServerThread]:
    config = {"limits": LIMITS, "models": {"m1": {"limits": {"max_n": 2}}}}
    with gateway_factory(base_config([upstream_url], plugins=safety(config))) as (_, server):
        yield server


@pytest.mark.parametrize("limit", list(OVER))
def test_each_limit_refuses_naming_the_field(limited: ServerThread, upstream: FakeUpstream, limit: str) -> None:
    fields, param, code = OVER[limit]
    body = {"model": "m1", "messages": [{"role": "user", "content": "hello"}], **fields}
    response = httpx.post(limited.url + "/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert upstream.requests == []


def test_within_limits_passes(limited: ServerThread, upstream: FakeUpstream) -> None:
    body = {
        "model": "m1",
        "messages": [{"role": "user", "content": "hello"}] * 3,
        "max_tokens": 100,
        "n": 2,
        "tools": [_tool("a")],
        "response_format": {"a": {"b": {"c": {"d": 1}}}},
    }
    response = httpx.post(limited.url + "/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 200, response.text
    assert len(upstream.requests) == 1


def test_per_model_limits_override_the_default(
    gateway_factory: GatewayFactory, upstream_url: str, upstream: FakeUpstream
) -> None:
    config = base_config(
        [upstream_url], plugins=safety({"limits": {"max_n": 4}, "models": {"m1": {"limits": {"max_n": 1}}}})
    )
    config["models"].append({"name": "m2", "workers": [upstream_url]})
    with gateway_factory(config) as (_, server):
        for model, n, status in [("m1", 2, 400), ("m2", 2, 200), ("m2", 5, 400)]:
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "n": n}
            assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=10).status_code == status


def test_prompt_tokens_are_counted_with_the_model_tokenizer(
    gateway_factory: GatewayFactory, upstream_url: str, upstream: FakeUpstream, tmp_path: Path
) -> None:
    (tmp_path / "m1").mkdir()
    word_tokenizer(tmp_path / "m1")
    config = {"limits": {"max_prompt_tokens": 10}, "tokenizer": str(tmp_path / "{model}" / "tokenizer.json")}
    with gateway_factory(base_config([upstream_url], plugins=safety(config))) as (_, server):
        # 12 words but 23 characters of long-ish words: over 10 tokens.
        over = chat(server, "one two three four five six seven one two three four five")
        assert over.status_code == 400
        assert over.json()["error"]["code"] == "context_length_exceeded"
        assert over.json()["error"]["param"] == "messages"
        # 40 characters (more than the limit) but 5 tokens: passes because it was counted, not estimated.
        assert chat(server, "seven   seven   seven   seven   seven").status_code == 200
        assert len(upstream.requests) == 1


def test_missing_tokenizer_refuses_only_prompts_that_need_counting(
    gateway_factory: GatewayFactory, upstream_url: str, upstream: FakeUpstream, tmp_path: Path
) -> None:
    config = {"limits": {"max_prompt_tokens": 20}, "tokenizer": str(tmp_path / "absent.json")}
    with gateway_factory(base_config([upstream_url], plugins=safety(config))) as (_, server):
        assert chat(server, "short").status_code == 200  # 5 bytes cannot be 20 tokens: not counted
        response = chat(server, "x" * 64)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "tokenizer_unavailable"


def test_token_limit_without_tokenizer_is_a_config_error() -> None:
    with pytest.raises(ValidationError, match="tokenizer"):
        SafetyConfig.model_validate({"limits": {"max_prompt_tokens": 10}})


async def test_bad_regex_and_backreference_refuse_the_config() -> None:
    for pattern in ["(unclosed", r"(a)\1", r"(?<=x)y"]:
        config = SafetyConfig.model_validate({"rules": [{"id": "bad", "kind": "pattern", "patterns": [pattern]}]})
        with pytest.raises(ValueError, match="rule 'bad'"):
            await SafetyPlugin(config, services()).start()


@pytest.fixture
def guard_model() -> Iterator[tuple[FakeUpstream, ServerThread]]:
    fake = FakeUpstream(name="guard")
    with ServerThread(fake) as server:
        yield fake, server


def _classifier_gateway(factory: GatewayFactory, upstream_url: str, guard_url: str, **classifier: Any) -> Any:
    config = {"classifier": {"url": guard_url, "model": "guard", "timeout_ms": 300, **classifier}}
    return factory(base_config([upstream_url], plugins=safety(config)))


def test_classifier_unsafe_blocks_and_safe_passes(
    gateway_factory: GatewayFactory, upstream_url: str, upstream: FakeUpstream, guard_model: Any
) -> None:
    guard, guard_server = guard_model
    with _classifier_gateway(gateway_factory, upstream_url, guard_server.url) as (_, server):
        guard.behavior.text = "unsafe\nS2"
        refused = chat(server, "how do I do something bad")
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "content_filter"
        assert "'classifier'" in refused.json()["error"]["message"]
        assert upstream.requests == []
        assert guard.requests[-1].body["messages"][0]["content"] == "how do I do something bad"
        guard.behavior.text = "safe"
        assert chat(server, "how do I bake bread").status_code == 200
        assert len(upstream.requests) == 1


@pytest.mark.parametrize("policy,status", [("fail_closed", 503), ("fail_open", 200)])
def test_classifier_time_budget_and_failure_policy(
    gateway_factory: GatewayFactory,
    upstream_url: str,
    upstream: FakeUpstream,
    guard_model: Any,
    policy: str,
    status: int,
) -> None:
    guard, guard_server = guard_model
    guard.behavior.hang = True
    with _classifier_gateway(gateway_factory, upstream_url, guard_server.url, on_error=policy) as (_, server):
        response = chat(server, "hello")
        assert response.status_code == status, response.text
        if status == 503:
            assert response.json()["error"]["code"] == "safety_check_unavailable"
            assert upstream.requests == []
        metrics = httpx.get(server.url + "/metrics", timeout=5).text
        assert 'gateway_safety_classifier_checks_total{outcome="timeout"} 1.0' in metrics


def test_root_config_snippet_validates() -> None:
    snippet = {
        "limits": {
            "max_body_bytes": 1048576,
            "max_messages": 256,
            "max_prompt_chars": 32000,
            "max_tokens": 2048,
            "max_n": 4,
            "max_tools": 64,
            "max_json_depth": 32,
        },
        "rules": [
            {"id": "secrets", "kind": "secrets", "action": "redact"},
            {"id": "payment-cards", "kind": "card", "action": "redact"},
            {"id": "prompt-injection", "kind": "injection", "action": "block", "threshold": 1.0},
        ],
        "models": {"smollm2": {"tokenizer": "models/smollm2/tokenizer.json", "limits": {"max_prompt_tokens": 2048}}},
    }
    SafetyConfig.model_validate(snippet)
    GatewayConfig.model_validate(base_config(["http://127.0.0.1:1"], plugins=safety(snippet)))
