"""Safety paths not driven elsewhere: every way the guard-model classifier can fail (and what each
policy makes of it), its log-only action and prompt truncation, per-model rule lists, rules on legacy
completions' prompts and answers, and the config refusals that name the rule or field at fault."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from plugins.safety import SafetyPlugin
from plugins.safety.config import SafetyConfig
from tests.server.test_app_lifecycle import read_body
from tests.support.fakes import FakeUpstream, ServerThread, free_port
from tests.support.gateways import GatewayFactory, base_config
from tests.support.safety import chat, safety, services
from tests.wire.test_error_shape import assert_error_shape


@pytest.fixture
def guard() -> Iterator[tuple[FakeUpstream, ServerThread]]:
    fake = FakeUpstream(name="guard")
    with ServerThread(fake) as server:
        yield fake, server


def metric_line(server: ServerThread, start: str) -> str:
    return next((line for line in httpx.get(server.url + "/metrics").text.splitlines() if line.startswith(start)), "")


def classifier_gateway(factory: GatewayFactory, upstream_url: str, guard_url: str, **classifier: Any) -> Any:
    config = {"classifier": {"url": guard_url, "model": "guard", "timeout_ms": 2000, **classifier}}
    return factory(base_config([upstream_url], plugins=safety(config)))


# -- the classifier ---------------------------------------------------------------------------------


class GuardReply:
    """A guard-model worker that answers every request with ``status`` and ``body``."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status, self.body = status, body

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await read_body(receive)
        await send(
            {"type": "http.response.start", "status": self.status, "headers": [(b"content-type", b"application/json")]}
        )
        await send({"type": "http.response.body", "body": self.body})


@pytest.mark.parametrize(
    ("status", "body", "log_words"),
    [
        pytest.param(500, b'{"message": "CUDA error"}', "answered HTTP 500", id="guard-500"),
        pytest.param(200, b'{"object": "list", "data": []}', "sent an unreadable reply", id="no-choices"),
        pytest.param(200, b"<html>", "sent an unreadable reply", id="not-json"),
    ],
)
@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
def test_a_failing_guard_model_follows_the_policy(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    caplog: pytest.LogCaptureFixture,
    status: int,
    body: bytes,
    log_words: str,
    policy: str,
) -> None:
    with (
        ServerThread(GuardReply(status, body), lifespan="off") as guard_server,
        classifier_gateway(gateway_factory, upstream_url, guard_server.url, on_error=policy) as (_, server),
    ):
        response = chat(server, "hello there")
        if policy == "fail_closed":
            error = assert_error_shape(response, 503)
            assert error["code"] == "safety_check_unavailable" and "failed" in error["message"]
            assert upstream.requests == []
        else:
            assert response.status_code == 200
            assert len(upstream.requests) == 1
        assert metric_line(server, 'gateway_safety_classifier_checks_total{outcome="error"}').endswith(" 1.0")
    assert f"safety classifier at {guard_server.url} {log_words}" in caplog.text


def test_an_unreachable_guard_model_is_an_error_not_a_timeout(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with classifier_gateway(gateway_factory, upstream_url, dead) as (_, server):
        error = assert_error_shape(chat(server, "hello"), 503)
        assert error["code"] == "safety_check_unavailable"
        assert metric_line(server, 'gateway_safety_classifier_checks_total{outcome="error"}').endswith(" 1.0")
    assert f"safety classifier at {dead} failed" in caplog.text


def test_a_log_only_classifier_lets_unsafe_prompts_through_and_counts_them(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, guard: tuple[FakeUpstream, ServerThread]
) -> None:
    fake_guard, guard_server = guard
    fake_guard.behavior.text = "UNSAFE S1"
    with classifier_gateway(gateway_factory, upstream_url, guard_server.url, action="log", rule_id="guard-log") as (
        _,
        server,
    ):
        assert chat(server, "something questionable").status_code == 200
        assert len(upstream.requests) == 1
        hits = metric_line(server, 'gateway_safety_rule_hits_total{action="log",direction="input",rule="guard-log"}')
        assert hits.endswith(" 1.0")


def test_the_classifier_sees_only_the_last_max_chars_of_a_long_prompt(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, guard: tuple[FakeUpstream, ServerThread]
) -> None:
    fake_guard, guard_server = guard
    fake_guard.behavior.text = "safe"
    with classifier_gateway(gateway_factory, upstream_url, guard_server.url, max_chars=10) as (_, server):
        body = {
            "model": "m1",
            "messages": [{"role": "system", "content": "be nice"}, {"role": "user", "content": "0123456789ABCDEFGHIJ"}],
        }
        assert httpx.post(server.url + "/v1/chat/completions", json=body).status_code == 200
    sent = fake_guard.requests[-1].body
    assert sent["messages"] == [{"role": "user", "content": "ABCDEFGHIJ"}]
    assert (sent["model"], sent["temperature"], sent["max_tokens"]) == ("guard", 0, 8)


# -- per-model rules, legacy completions ---------------------------------------------------------------


def test_a_model_with_its_own_rules_does_not_get_the_global_ones(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    config = {
        "rules": [{"id": "no-bluebird", "kind": "words", "words": ["bluebird"]}],
        "models": {"m2": {"rules": [{"id": "no-redwood", "kind": "words", "words": ["redwood"]}]}},
    }
    cfg = base_config([upstream_url], plugins=safety(config))
    cfg["models"].append({"name": "m2", "workers": [upstream_url]})
    with gateway_factory(cfg) as (_, server):
        assert chat(server, "about bluebird").status_code == 400
        assert chat(server, "about redwood").status_code == 200
        assert chat(server, "about bluebird", model="m2").status_code == 200
        refused = assert_error_shape(chat(server, "about redwood", model="m2"), 400)
        assert refused["code"] == "content_filter" and "'no-redwood'" in refused["message"]


def test_a_model_with_safety_disabled_is_not_checked(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    config = {
        "rules": [{"id": "no-bluebird", "kind": "words", "words": ["bluebird"]}],
        "limits": {"max_messages": 1},
        "models": {"m2": {"enabled": False}},
    }
    cfg = base_config([upstream_url], plugins=safety(config))
    cfg["models"].append({"name": "m2", "workers": [upstream_url]})
    with gateway_factory(cfg) as (_, server):
        two = [{"role": "user", "content": "bluebird"}, {"role": "user", "content": "bluebird"}]
        assert assert_error_shape(chat(server, "x", messages=two), 400)["param"] == "messages"
        assert chat(server, "x", messages=two, model="m2").status_code == 200


def test_rules_check_legacy_completion_prompts_and_answers(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    config = {"rules": [{"id": "mail", "kind": "email", "action": "redact", "apply_to": ["input", "output"]}]}
    upstream.behavior.text = "Write to bob@example.com for details."
    body = {"model": "m1", "prompt": ["mail alice@example.org", "and carol@example.net"], "max_tokens": 5}
    with gateway_factory(base_config([upstream_url], plugins=safety(config))) as (_, server):
        response = httpx.post(server.url + "/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert upstream.requests[-1].body["prompt"] == ["mail [EMAIL]", "and [EMAIL]"]
        assert response.json()["choices"][0]["text"] == "Write to [EMAIL] for details."


def test_a_blocking_output_rule_cuts_a_legacy_completion_at_the_match(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    config = {"rules": [{"id": "no-codename", "kind": "words", "words": ["bluebird"], "apply_to": ["output"]}]}
    upstream.behavior.text = "The plan is called bluebird and it starts now."
    with gateway_factory(base_config([upstream_url], plugins=safety(config))) as (_, server):
        response = httpx.post(server.url + "/v1/completions", json={"model": "m1", "prompt": "tell me"})
    choice = response.json()["choices"][0]
    assert choice["text"] == "The plan is called " and choice["finish_reason"] == "content_filter"


def test_embedding_inputs_are_screened(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    config = {"rules": [{"id": "no-bluebird", "kind": "words", "words": ["bluebird"]}]}
    with gateway_factory(base_config([upstream_url], plugins=safety(config))) as (_, server):
        refused = httpx.post(server.url + "/v1/embeddings", json={"model": "m1", "input": ["fine", "bluebird"]})
        error = assert_error_shape(refused, 400)
        assert (error["param"], error["code"]) == ("input", "content_filter")
        assert httpx.post(server.url + "/v1/embeddings", json={"model": "m1", "input": "fine"}).status_code == 200
    assert [r.path for r in upstream.requests] == ["/v1/embeddings"]


# -- config refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"rules": [{"id": "p", "kind": "pattern"}]}, "rule 'p': kind 'pattern' needs 'patterns'"),
        ({"rules": [{"id": "w", "kind": "words"}]}, "rule 'w': kind 'words' needs 'words'"),
        ({"rules": [{"id": "g", "kind": "gov_id"}]}, "rule 'g': kind 'gov_id' needs 'formats'"),
        ({"rules": [{"id": "bad id!", "kind": "email"}]}, "String should match pattern"),
        ({"rules": [{"id": "e", "kind": "email", "apply_to": []}]}, "List should have at least 1 item"),
        (
            {"rules": [{"id": "e", "kind": "email"}, {"id": "e", "kind": "ip"}]},
            "rules: rule ids must be unique; repeated: e",
        ),
        (
            {"models": {"m1": {"rules": [{"id": "x", "kind": "email"}, {"id": "x", "kind": "card"}]}}},
            "models.m1.rules: rule ids must be unique; repeated: x",
        ),
        ({"models": {"m1": {"limits": {"max_cats": 3}}}}, "unknown limits: max_cats"),
        ({"models": {"m1": {"limits": {"max_messages": 0}}}}, "greater than or equal to 1"),
        ({"limits": {"max_prompt_tokens": 100}}, "limits.max_prompt_tokens needs 'tokenizer'"),
        (
            {"models": {"m1": {"limits": {"max_prompt_tokens": 100}}}},
            "models.m1: max_prompt_tokens needs a 'tokenizer'",
        ),
        ({"classifier": {"url": "ftp://guard", "model": "g"}}, "String should match pattern"),
        ({"output": {"hold_back_chars": 0}}, "greater than or equal to 1"),
    ],
)
def test_safety_config_refusals_name_the_rule_or_field(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        SafetyConfig.model_validate(config)


def test_a_per_model_tokenizer_satisfies_a_per_model_token_limit() -> None:
    config = SafetyConfig.model_validate(
        {"models": {"m1": {"tokenizer": "/models/m1/tokenizer.json", "limits": {"max_prompt_tokens": 100}}}}
    )
    assert config.limits_for("m1").max_prompt_tokens == 100 and config.limits_for("m2").max_prompt_tokens is None
    templated = SafetyConfig.model_validate({"tokenizer": "/models/{model}/tokenizer.json"})
    assert templated.tokenizer_for("m7") == "/models/m7/tokenizer.json"


async def test_an_unsafe_pattern_that_re2_cannot_compile_refuses_the_config() -> None:
    config = SafetyConfig.model_validate(
        {"classifier": {"url": "http://127.0.0.1:9", "model": "g", "unsafe_pattern": "(?<=x)unsafe"}}
    )
    with pytest.raises(ValueError, match=r"^safety: "):
        await SafetyPlugin(config, services()).start()
