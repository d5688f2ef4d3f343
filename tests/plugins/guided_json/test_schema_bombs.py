"""Schema bombs and catastrophic regexes in a request, with the guided_json plugin enabled.

Every constraint is compiled at the gateway under budgets (size, nodes, automaton states, time)
before a worker sees it. An explosive one is refused with 400 naming the field and makes no upstream
call; a benign one that only looks scary is served. Either way the gateway keeps answering other
requests while a compile runs (compiles happen in a worker thread, never on the event loop).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config

MESSAGES = [{"role": "user", "content": "hi"}]


def _schema(schema: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def _fanout_defs(levels: int, width: int) -> dict[str, Any]:
    """Billion laughs for JSON schema: each level refers to the next one ``width`` times."""
    defs: dict[str, Any] = {f"l{levels}": {"type": "string"}}
    for level in range(levels - 1, -1, -1):
        defs[f"l{level}"] = {
            "type": "object",
            "properties": {f"p{i}": {"$ref": f"#/$defs/l{level + 1}"} for i in range(width)},
            "required": [f"p{i}" for i in range(width)],
        }
    return {"$ref": "#/$defs/l0", "$defs": defs}


def _nested_anyof(depth: int) -> dict[str, Any]:
    """Alternatives inside alternatives: 4**depth paths for an automaton (and as many serialised leaves)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {
            "anyOf": [
                {"type": "array", "items": schema},
                {"type": "object", "properties": {"a": schema}, "required": ["a"]},
                {"type": "object", "properties": {"b": schema}, "required": ["b"]},
                {"type": "object", "properties": {"c": schema}, "required": ["c"]},
            ]
        }
    return schema


# (request fields, param the refusal names)
BOMBS: list[tuple[dict[str, Any], str]] = [
    (_schema(_fanout_defs(levels=10, width=10)), "response_format"),  # 10**10 leaves once inlined
    (_schema(_nested_anyof(6)), "response_format"),
    (_schema({"type": "array", "items": {"type": "integer"}, "minItems": 100_000}), "response_format"),
    (_schema({"type": "string", "minLength": 10**9}), "response_format"),
    (
        _schema({"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(20_000)}}),
        "response_format",
    ),
    (_schema({"enum": [f"value-{i}" for i in range(100_000)]}), "response_format"),
    (_schema({"type": "string", "pattern": "(a|b)*a(a|b){24}"}), "response_format"),
    ({"structured_outputs": {"regex": "(a|b)*a(a|b){24}"}}, "structured_outputs"),  # 2**24 DFA states
    ({"structured_outputs": {"regex": "[a-z]{1000000}"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "((((a{100}){100}){100}){100})"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": [f"c{i}" for i in range(100_000)]}}, "structured_outputs"),
]
# Pathological for a backtracking engine, small for an automaton: served.
BENIGN = [
    {"structured_outputs": {"regex": "(a|aa)*b"}},
    {"structured_outputs": {"regex": "(a*)*b"}},
    {"guided_regex": "(x+x+)+y"},
    {"guided_regex": "(.*a){30}(.*b){30}"},
]


@pytest.fixture
def guided(gateway_factory: GatewayFactory, upstream_url: str) -> Iterator[ServerThread]:
    plugins: list[dict[str, Any]] = [
        {"name": "guided_json", "config": {"probe": False, "compile_timeout_ms": 1500}},
        {"name": "routing"},
    ]
    with gateway_factory(base_config([upstream_url], plugins=plugins)) as (_, server):
        yield server


def _chat(server: ServerThread, **fields: Any) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/chat/completions", json={"model": "m1", "messages": MESSAGES, **fields}, timeout=60
    )


BOMB_IDS = [
    "fanout-defs",
    "nested-anyof",
    "min-items",
    "min-length",
    "wide-object",
    "huge-enum",
    "pattern-in-schema",
    "dfa-blowup",
    "long-repeat",
    "nested-repeat",
    "huge-choice",
]


@pytest.mark.parametrize(("fields", "param"), BOMBS, ids=BOMB_IDS)
def test_schema_bombs_and_explosive_regexes_are_refused_before_the_worker(
    guided: ServerThread, upstream: FakeUpstream, fields: dict[str, Any], param: str
) -> None:
    response = _chat(guided, **fields)
    assert response.status_code in (400, 413), response.text[:300]
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    if response.status_code == 400:
        assert error["param"] == param, error
    assert upstream.requests == []


@pytest.mark.parametrize("fields", BENIGN, ids=["alternation", "nested-star", "nested-plus", "dotstar-repeats"])
def test_backtracking_traps_compile_small_and_are_served(
    guided: ServerThread, upstream: FakeUpstream, fields: dict[str, Any]
) -> None:
    response = _chat(guided, **fields)
    assert response.status_code in (200, 422), response.text[:300]  # 422: the fake's text fails validation
    assert len(upstream.requests) >= 1
    assert "regex" in upstream.requests[0].body["structured_outputs"]


def test_plain_requests_are_served_while_bombs_compile(guided: ServerThread, upstream: FakeUpstream) -> None:
    bombs = [fields for fields, _ in BOMBS[:4]] + [BOMBS[7][0]]
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(bombs)) as pool:
        pending = [pool.submit(_chat, guided, **fields) for fields in bombs]
        plain = [_chat(guided) for _ in range(5)]
        refused = [f.result(timeout=120) for f in pending]
    assert [r.status_code for r in plain] == [200] * 5, [r.text[:200] for r in plain]
    # Refused, or told to retry: one compile thread serves them in turn, and a bomb queued behind
    # others longer than the budget gets 503 guided_compiler_busy (retry-after) instead of waiting.
    for reply in refused:
        assert reply.status_code in (400, 413) or reply.json()["error"]["code"] == "guided_compiler_busy", reply.text
    assert len(upstream.requests) == 5


def test_an_exploding_automaton_does_not_hold_the_compiler_after_its_refusal(
    guided: ServerThread, upstream: FakeUpstream
) -> None:
    """The refused compile is ended, not left running: the next constraint compiles at once (it used
    to wait behind the runaway build and get 503 guided_compiler_busy, for hours)."""
    for n in (22, 23, 24):
        refused = _chat(guided, structured_outputs={"regex": f"(a|b)*a(a|b){{{n}}}"})
        assert refused.status_code == 400, refused.text
        assert "too complex" in refused.json()["error"]["message"]
        served = _chat(guided, structured_outputs={"regex": f"[a-z]{{{n}}}"})
        assert served.status_code in (200, 422), served.text  # 422: the fake's text fails validation
    assert len(upstream.requests) == 3
