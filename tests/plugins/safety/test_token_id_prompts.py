"""Prompts given as token ids (``/v1/completions`` ``prompt``, ``/v1/embeddings`` ``input``): the gateway
cannot decode them, so where a rule or the classifier would act on the prompt's text they are refused (400
``token_ids_not_allowed``); where every check only logs they pass and are counted as unread; and they always
count against ``max_prompt_tokens``, one token per id."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.support.safety import rules, safety, word_tokenizer

# (route, field, value): every form of token-id prompt the two routes take, and a batch mixing them with text.
TOKEN_PROMPTS = [
    ("completions", "prompt", [101, 2023, 2003]),
    ("completions", "prompt", [[101, 2023], [101, 2003, 7]]),
    ("embeddings", "input", [101, 2023, 2003]),
    ("embeddings", "input", [[101, 2023], [101, 2003, 7]]),
    ("embeddings", "input", ["a text", [101, 2023]]),
    # vLLM coerces a digit string inside a list of ids to an id: still token ids, not a text "5".
    ("embeddings", "input", ["5", 2023, 2003]),
]
IDS = [f"{route}-{i}" for i, (route, _, _) in enumerate(TOKEN_PROMPTS)]


def _unread(server: ServerThread, field: str) -> float:
    """``gateway_safety_unread_prompts`` for ``field`` on this gateway (0 before the first)."""
    start = f'gateway_safety_unread_prompts_total{{param="{field}"}} '
    lines = httpx.get(server.url + "/metrics").text.splitlines()
    return next((float(line.removeprefix(start)) for line in lines if line.startswith(start)), 0.0)


def _post(server: ServerThread, route: str, field: str, value: Any, **extra: Any) -> httpx.Response:
    body = {"model": "m1", field: value, **extra}
    if route == "completions":
        body.setdefault("max_tokens", 3)
    return httpx.post(f"{server.url}/v1/{route}", json=body, timeout=10)


@pytest.fixture
def gateway_with(gateway_factory: GatewayFactory, upstream_url: str) -> Iterator[Any]:
    """``gateway_with(safety_config)``: a gateway with safety so configured in front of the fake worker."""
    stack: list[Any] = []

    def make(config: dict[str, Any]) -> ServerThread:
        cm = gateway_factory(base_config([upstream_url], plugins=safety(config)))
        stack.append(cm)
        return cm.__enter__()[1]

    yield make
    for cm in reversed(stack):
        cm.__exit__(None, None, None)


@pytest.mark.parametrize("action", ["block", "redact"])
@pytest.mark.parametrize(("route", "field", "value"), TOKEN_PROMPTS, ids=IDS)
def test_token_ids_are_refused_where_input_rules_act(
    gateway_with: Any, upstream: FakeUpstream, route: str, field: str, value: Any, action: str
) -> None:
    server = gateway_with({"rules": rules(action)})
    response = _post(server, route, field, value)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "token_ids_not_allowed", field)
    assert "token ids" in error["message"] and f"Send '{field}' as text" in error["message"]
    assert upstream.requests == []
    assert _unread(server, field) == 0


@pytest.mark.parametrize(("route", "field", "value"), TOKEN_PROMPTS, ids=IDS)
def test_token_ids_pass_and_are_counted_where_every_rule_only_logs(
    gateway_with: Any, upstream: FakeUpstream, route: str, field: str, value: Any
) -> None:
    # An observe-only policy must not change what clients get: the prompt goes on as sent, and the
    # operator sees how many prompts no rule could read.
    server = gateway_with({"rules": rules("log")})
    for sent in (1, 2):
        response = _post(server, route, field, value)
        assert response.status_code == 200, response.text
        assert upstream.requests[-1].body[field] == value
        assert _unread(server, field) == sent


def test_one_acting_rule_among_logging_ones_refuses_token_ids(gateway_with: Any, upstream: FakeUpstream) -> None:
    server = gateway_with({"rules": [*rules("log"), {"id": "w", "kind": "words", "words": ["x"], "action": "block"}]})
    response = _post(server, "completions", "prompt", [101, 2023])
    assert response.json()["error"]["code"] == "token_ids_not_allowed"
    assert upstream.requests == []


def test_a_classifier_that_only_logs_lets_token_ids_pass(
    gateway_with: Any, upstream: FakeUpstream, upstream_url: str
) -> None:
    server = gateway_with({"classifier": {"url": upstream_url, "model": "guard", "action": "log"}})
    response = _post(server, "completions", "prompt", [101, 2023])
    assert response.status_code == 200, response.text
    assert [r.body["model"] for r in upstream.requests] == ["m1"]  # the guard model was not asked about ids
    assert _unread(server, "prompt") == 1


@pytest.mark.parametrize(("route", "field", "value"), TOKEN_PROMPTS[:3], ids=IDS[:3])
def test_token_ids_are_refused_where_the_classifier_applies(
    gateway_with: Any, upstream: FakeUpstream, upstream_url: str, route: str, field: str, value: Any
) -> None:
    # No rules, only the guard model (served by the same fake worker): it could only be asked about text.
    server = gateway_with({"classifier": {"url": upstream_url, "model": "guard"}})
    response = _post(server, route, field, value)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "token_ids_not_allowed"
    assert upstream.requests == []  # neither the guard model nor the worker was asked


def test_a_model_without_text_rules_takes_token_ids(
    gateway_factory: GatewayFactory, upstream_url: str, upstream: FakeUpstream
) -> None:
    config = base_config([upstream_url], plugins=safety({"rules": rules("block"), "models": {"m2": {"rules": []}}}))
    config["models"].append({"name": "m2", "workers": [upstream_url]})
    with gateway_factory(config) as (_, server):
        for route, field, value in TOKEN_PROMPTS:
            body = {"model": "m2", field: value, **({"max_tokens": 3} if route == "completions" else {})}
            response = httpx.post(f"{server.url}/v1/{route}", json=body, timeout=10)
            assert response.status_code == 200, response.text
            assert upstream.requests[-1].body[field] == value  # sent on as the client wrote them
        refused = httpx.post(f"{server.url}/v1/completions", json={"model": "m1", "prompt": [1, 2]}, timeout=10)
        assert refused.json()["error"]["code"] == "token_ids_not_allowed"


@pytest.fixture
def token_limited(gateway_with: Any, tmp_path: Path) -> ServerThread:
    """max_prompt_tokens 10 and no rules: token ids pass, up to the limit."""
    return gateway_with({"limits": {"max_prompt_tokens": 10}, "tokenizer": word_tokenizer(tmp_path)})


@pytest.mark.parametrize(
    ("route", "field", "over", "within"),
    [
        ("completions", "prompt", list(range(11)), list(range(10))),
        ("completions", "prompt", [list(range(6)), list(range(5))], [list(range(5)), list(range(5))]),
        ("embeddings", "input", list(range(11)), list(range(10))),
        ("embeddings", "input", [list(range(6)), list(range(5))], [list(range(5)), list(range(5))]),
    ],
    ids=["completions-one", "completions-batch", "embeddings-one", "embeddings-batch"],
)
def test_token_ids_count_against_max_prompt_tokens(
    token_limited: ServerThread, upstream: FakeUpstream, route: str, field: str, over: Any, within: Any
) -> None:
    refused = _post(token_limited, route, field, over)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", field)
    assert "11 tokens" in error["message"]
    assert upstream.requests == []
    passed = _post(token_limited, route, field, within)
    assert passed.status_code == 200, passed.text
    assert upstream.requests[-1].body[field] == within


def test_token_ids_and_the_suffix_text_count_together(token_limited: ServerThread, upstream: FakeUpstream) -> None:
    # 8 ids and a 3-word suffix (3 tokens with the model's tokenizer): 11, over 10; with 2 words, 10.
    over = _post(token_limited, "completions", "prompt", list(range(8)), suffix="one two three")
    assert over.status_code == 400, over.text
    assert over.json()["error"]["code"] == "context_length_exceeded"
    assert _post(token_limited, "completions", "prompt", list(range(8)), suffix="one two").status_code == 200
