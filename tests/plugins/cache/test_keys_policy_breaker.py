"""The cache key, the caching policy and the circuit breaker, as pure functions."""

from __future__ import annotations

from typing import Any

import pytest

from plugins.cache.breaker import CircuitBreaker
from plugins.cache.config import CacheConfig
from plugins.cache.keys import entry_pattern, make_key
from plugins.cache.policy import decide, is_complete, is_deterministic, parse_cache_control
from tests.support.clock import Clock

BASE: dict[str, Any] = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


def key(body: dict[str, Any], **overrides: Any) -> str:
    args: dict[str, Any] = {
        "prefix": "gwcache",
        "namespace": "v1",
        "tenant": None,
        "default_scope": "public",
        "endpoint": "chat/completions",
        "model": "m1",
        "body": body,
        **overrides,
    }
    return make_key(**args).entry


OUTPUT_FIELDS: list[tuple[str, Any]] = [
    ("messages", [{"role": "user", "content": "hello"}]),
    ("temperature", 0.5),
    ("top_p", 0.9),
    ("top_k", 5),
    ("min_p", 0.1),
    ("max_tokens", 7),
    ("max_completion_tokens", 7),
    ("seed", 3),
    ("stop", ["x"]),
    ("presence_penalty", 0.5),
    ("frequency_penalty", 0.5),
    ("repetition_penalty", 1.1),
    ("logit_bias", {"50256": -100}),
    ("logprobs", True),
    ("top_logprobs", 2),
    ("n", 2),
    ("response_format", {"type": "json_object"}),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    ("tool_choice", "none"),
    ("parallel_tool_calls", False),
    ("guided_json", {"type": "object"}),
    ("chat_template_kwargs", {"enable_thinking": False}),
]


@pytest.mark.parametrize(("field", "value"), OUTPUT_FIELDS, ids=[f for f, _ in OUTPUT_FIELDS])
def test_every_output_relevant_field_changes_the_key(field: str, value: Any) -> None:
    assert key({**BASE, field: value}) != key(BASE)


DELIVERY_FIELDS: list[tuple[str, Any]] = [
    ("stream", True),
    ("stream_options", {"include_usage": True}),
    ("user", "alice"),
    ("request_id", "abc"),
    ("metadata", {"run": "1"}),
    ("store", True),
    ("n", 1),
    ("seed", None),
    ("model", "alias-1"),
]


@pytest.mark.parametrize(("field", "value"), DELIVERY_FIELDS, ids=[f for f, _ in DELIVERY_FIELDS])
def test_fields_that_do_not_change_the_answer_leave_the_key_alone(field: str, value: Any) -> None:
    assert key({**BASE, field: value}) == key(BASE)


@pytest.mark.parametrize("field", [{"return_token_ids": True}, {"prompt_logprobs": 0}, {"prompt_logprobs": 1}])
def test_token_ids_and_prompt_logprobs_keep_streamed_and_whole_answers_apart(field: dict[str, Any]) -> None:
    # vLLM sends the token ids a stream asked for on its events (prompt_token_ids on the first, token_ids per
    # choice) and on a whole answer's object: assembling one shape from the other drops them, and vLLM
    # refuses prompt_logprobs on a stream. Such requests must not be answered from the other shape's entry.
    asked = {**BASE, **field}
    assert key({**asked, "stream": True}) != key(asked)
    assert key({**asked, "stream": False}) == key(asked)
    assert key({**BASE, "return_token_ids": False, "stream": True}) == key({**BASE, "return_token_ids": False})


def test_top_level_order_and_number_spelling_do_not_matter() -> None:
    reordered = {"temperature": 0.0, "messages": BASE["messages"], "model": "m1"}
    assert key(reordered) == key(BASE)


def test_a_whole_number_too_large_for_json_integers_is_keyed_as_sent() -> None:
    # 1e30 has no fraction, but as an integer it exceeds what JSON serialization takes (64 bits): the key
    # must still be made (not fail the plugin on a client's value), and tell such values apart.
    assert key({**BASE, "top_k": 1e30}) == key({**BASE, "top_k": 1e30})
    assert key({**BASE, "top_k": 1e30}) != key({**BASE, "top_k": 1e29})
    assert key({**BASE, "top_k": -1e30}) != key(BASE)


def test_nested_order_matters_because_schema_order_shapes_the_output() -> None:
    a = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}}}
    b = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "string"}}}
    assert key({**BASE, "guided_json": a}) != key({**BASE, "guided_json": b})


@pytest.mark.parametrize(
    "override",
    [
        {"namespace": "v2"},
        {"tenant": "acme"},
        {"tenant": "public"},  # a tenant named like the default scope is still another scope
        {"model": "m2"},
        {"endpoint": "completions"},
    ],
)
def test_namespace_tenant_model_and_endpoint_are_part_of_the_key(override: dict[str, Any]) -> None:
    assert key(BASE, **override) != key(BASE)


def test_purge_patterns_only_match_their_own_model() -> None:
    entry = make_key(
        prefix="gwcache", namespace="v1", tenant=None, default_scope="p", endpoint="e", model="a:b", body=BASE
    ).entry
    assert entry.startswith("gwcache:v1:e:a%3Ab:{")
    assert entry_pattern("gwcache", "v1", "a") == "gwcache:v1:e:a:*"
    assert entry_pattern("gwcache", "v1", "m[1]*") == "gwcache:v1:e:m%5B1%5D%2A:*"
    assert entry_pattern("gwcache", "v1", None) == "gwcache:v1:e:*"


def test_cache_control_parsing() -> None:
    assert parse_cache_control("no-cache") == (True, False, None)
    assert parse_cache_control("No-Store, max-age=30") == (False, True, 30)
    assert parse_cache_control('max-age="5", private') == (False, False, 5)
    assert parse_cache_control("max-age=soon") == (False, False, None)
    # a digit that is not ASCII ("\xb2" as a latin-1 header byte reads): ignored, not a ValueError
    assert parse_cache_control("max-age=\u00b2") == (False, False, None)


def test_policy_decisions() -> None:
    config = CacheConfig(model_ttl_s={"m2": 0})
    assert not decide(config, "chat/completions", "m1", {"temperature": 0.7}, {}).lookup
    assert decide(config, "chat/completions", "m1", {"temperature": 0.7}, {}).reason == "nondeterministic"
    assert decide(config, "chat/completions", "m2", BASE, {}).reason == "model_disabled"
    assert decide(config, "embeddings", "m1", {"input": "x"}, {}).reason == "endpoint"
    plain = decide(config, "chat/completions", "m1", BASE, {})
    assert (plain.lookup, plain.store) == (True, True)
    no_cache = decide(config, "chat/completions", "m1", BASE, {"cache-control": "no-cache"})
    assert (no_cache.lookup, no_cache.store) == (False, True)
    both = decide(config, "chat/completions", "m1", BASE, {"cache-control": "no-cache, no-store"})
    assert both.bypass and both.reason == "cache_control"
    aged = decide(config, "chat/completions", "m1", BASE, {"cache-control": "max-age=9"})
    assert (aged.lookup, aged.max_age_s) == (True, 9)
    everything = CacheConfig(only_deterministic=False, endpoints=("chat/completions", "embeddings"))
    assert decide(everything, "chat/completions", "m1", {"temperature": 0.7}, {}).lookup


def test_determinism() -> None:
    assert is_deterministic("chat/completions", {"temperature": 0})
    assert is_deterministic("chat/completions", {"temperature": 0.7, "seed": 1})
    assert not is_deterministic("chat/completions", {})
    assert not is_deterministic("chat/completions", {"temperature": False, "seed": True})
    assert is_deterministic("embeddings", {})


def test_only_complete_answers_are_storable() -> None:
    assert is_complete({"choices": [{"finish_reason": "stop"}, {"finish_reason": "length"}]})
    assert not is_complete({"choices": [{"finish_reason": "stop"}, {"finish_reason": None}]})
    assert not is_complete({"choices": [{"finish_reason": "abort"}]})
    assert not is_complete({"error": {"message": "x"}})
    assert is_complete({"object": "list", "data": []})


def test_breaker_opens_after_failures_then_lets_one_probe_through() -> None:
    clock = Clock(100.0)
    breaker = CircuitBreaker(failures=2, cooldown_s=5, clock=clock)
    breaker.failure()
    assert breaker.allow() and breaker.state == "closed"
    breaker.failure()
    assert breaker.state == "open" and not breaker.allow()
    clock.now += 5
    assert breaker.state == "half_open"
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # everyone else waits for the probe
    breaker.failure()
    assert breaker.state == "open" and not breaker.allow()
    clock.now += 5
    assert breaker.allow()
    breaker.success()
    assert breaker.state == "closed" and breaker.allow() and breaker.allow()


def test_a_probe_that_never_reports_gives_up_its_slot() -> None:
    clock = Clock(100.0)
    breaker = CircuitBreaker(failures=1, cooldown_s=2, clock=clock)
    breaker.failure()
    clock.now += 2
    assert breaker.allow()
    assert not breaker.allow()
    clock.now += 2
    assert breaker.allow()
