"""Clients' regular expressions and schemas that are checked at the gateway, through the gateway.

- A guided regex and a JSON schema's ``pattern`` / ``patternProperties`` are checked against the
  worker's answer on the event loop: with a backtracking engine, ``(a|aa)*c`` against 36 ``a``s held the
  loop for about 3 s (every other request waited). They run on RE2 now; what RE2 cannot run is a 400
  ``unsupported_regex`` before anything reaches a worker.
- A ``$ref`` that points at something other than a schema is a 400 at request time (it was a 503
  once the worker had answered).
- A forced tool call's ``parameters`` schema (the worker decodes the call under it), and with
  ``tool_choice: "required"`` every tool's, goes through the same compile budgets as the same schema in
  ``response_format``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config

EVIL = "(a|aa)*c"  # exponential for a backtracking engine on a run of "a"s with no "c"
RUN = "a" * 36


@pytest.fixture
def guided(gateway_factory: GatewayFactory, upstream_url: str) -> Iterator[ServerThread]:
    plugins: list[dict[str, Any]] = [
        {"name": "guided_json", "config": {"probe": False, "compile_timeout_ms": 1500}},
        {"name": "routing"},
    ]
    with gateway_factory(base_config([upstream_url], plugins=plugins)) as (_, server):
        yield server


def _chat(server: ServerThread, **fields: Any) -> httpx.Response:
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], **fields}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def _schema(schema: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


#: Polls a URL for ``seconds`` and prints the slowest answer's time and the number of polls. A process of its
#: own, as another client is: a backtracking match holds the GIL, so a thread of the gateway's process
#: cannot even start timing a poll while the loop is held.
_POLLER = """
import sys, time, httpx
url, seconds = sys.argv[1], float(sys.argv[2])
longest, polls = 0.0, 0
with httpx.Client(timeout=120) as client:
    client.get(url)
    print("ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.perf_counter()
        assert client.get(url).status_code == 200
        longest, polls = max(longest, time.perf_counter() - started), polls + 1
        time.sleep(0.01)
print(longest, polls, flush=True)
"""


class LoopWatch:
    """``/health`` polled by another process while the block runs; ``longest`` is its slowest answer: the
    event loop's longest pause, within a poll's own latency."""

    def __init__(self, server: ServerThread, seconds: float = 2.0) -> None:
        self.args = [sys.executable, "-c", _POLLER, server.url + "/health", str(seconds)]
        self.longest, self.polls = 0.0, 0

    def __enter__(self) -> LoopWatch:
        self._process = subprocess.Popen(self.args, stdout=subprocess.PIPE, text=True)
        assert self._process.stdout is not None and self._process.stdout.readline().strip() == "ready"
        return self

    def __exit__(self, *exc: object) -> None:
        out, _ = self._process.communicate(timeout=120)
        longest, polls = out.split()
        self.longest, self.polls = float(longest), int(polls)


# (request fields, the worker's answer, its finish_reason, the status the client gets)
EVIL_CHECKS = [
    ({"guided_regex": EVIL}, RUN, "length", 200),  # a cut answer is checked too, then returned as it is
    ({"structured_outputs": {"regex": EVIL}}, RUN + "b", "stop", 422),
    (
        _schema({"type": "object", "properties": {"s": {"type": "string", "pattern": EVIL}}}),
        f'{{"s": "{RUN}"}}',
        "stop",
        422,
    ),
    (  # a name no pattern matches is checked against additionalProperties' schema: matched once more
        _schema(
            {
                "type": "object",
                "patternProperties": {EVIL: {"type": "string"}},
                "additionalProperties": {"type": "integer"},
            }
        ),
        f'{{"{RUN}": 1}}',
        "stop",
        200,
    ),
]


@pytest.mark.parametrize(
    ("fields", "answer", "finish", "status"), EVIL_CHECKS, ids=["guided-regex", "so-regex", "pattern", "pattern-props"]
)
def test_checking_an_answer_against_a_backtracking_trap_does_not_hold_the_event_loop(
    guided: ServerThread, upstream: FakeUpstream, fields: dict[str, Any], answer: str, finish: str, status: int
) -> None:
    upstream.behavior.text, upstream.behavior.finish_reason = answer, finish
    assert _chat(guided, **fields).status_code in (200, 422)  # compiled and kept: the second one only checks
    with LoopWatch(guided) as watch:
        reply = _chat(guided, **fields)
    assert reply.status_code == status, reply.text
    assert watch.polls > 0
    # Python's re took about 3 s on this answer; RE2 microseconds. A second is any busy machine's slack.
    assert watch.longest < 1.0, f"the event loop stalled for {watch.longest:.2f} s"


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"guided_regex": r"(a)\1"}, "guided_regex", "invalid escape sequence"),  # a backreference
        ({"structured_outputs": {"regex": "(?=a)a"}}, "structured_outputs", "invalid perl operator"),  # look-ahead
        ({"structured_outputs": {"regex": "a{1001}"}}, "structured_outputs", "invalid repetition size"),
        (_schema({"type": "string", "pattern": "(?<!x)y"}), "response_format", "at (top level)"),
        (
            _schema({"type": "object", "properties": {"k": {"type": "string", "pattern": r"(\w)\1"}}}),
            "response_format",
            "at properties/k",
        ),
        (
            _schema({"type": "object", "patternProperties": {"(?=k)k": {"type": "string"}}}),
            "response_format",
            "at (top level)",
        ),
        (
            _schema({"type": "object", "patternProperties": {"^k": {}}, "unevaluatedProperties": False}),
            "response_format",
            "unevaluatedProperties together with patternProperties",
        ),
    ],
    ids=["backreference", "lookahead", "repeat-1001", "lookbehind-in-schema", "nested", "pattern-props", "unevaluated"],
)
def test_a_pattern_re2_cannot_run_is_refused_before_the_worker(
    guided: ServerThread, upstream: FakeUpstream, fields: dict[str, Any], param: str, words: str
) -> None:
    reply = _chat(guided, **fields)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "unsupported_regex", param)
    assert words in error["message"]
    assert upstream.requests == []
    again = _chat(guided, **fields)  # the refusal is remembered with its code
    assert again.json() == reply.json()


def test_patterns_are_still_enforced(guided: ServerThread, upstream: FakeUpstream) -> None:
    names = {
        "type": "object",
        "patternProperties": {"^n[0-9]$": {"type": "integer"}},
        "additionalProperties": {"type": "string"},
    }
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}, "m": names}}
    upstream.behavior.text = '{"code": "ABC", "m": {"n1": 3, "x": "s"}}'
    assert _chat(guided, **_schema(schema)).status_code == 200
    for bad, words in [
        ('{"code": "abc"}', "at code: 'abc' does not match '^[A-Z]{3}$'"),
        ('{"code": "ABC", "m": {"n1": "three"}}', "at m/n1: 'three' is not of type 'integer'"),
        ('{"code": "ABC", "m": {"x": 1}}', "at m/x: 1 is not of type 'string'"),
    ]:
        upstream.behavior.text = bad
        reply = _chat(guided, **_schema(schema))
        assert reply.status_code == 422, reply.text
        assert words in reply.json()["error"]["message"]
    upstream.behavior.text = "ab12"
    assert _chat(guided, guided_regex="[a-z]+[0-9]+").status_code == 200
    upstream.behavior.text = "ab12x"
    assert _chat(guided, guided_regex="[a-z]+[0-9]+").status_code == 422


def test_a_pattern_inside_an_enum_value_is_data_not_a_pattern(guided: ServerThread, upstream: FakeUpstream) -> None:
    upstream.behavior.text = '{"pattern": "(?=x)"}'
    reply = _chat(guided, **_schema({"enum": [{"pattern": "(?=x)"}]}))
    assert reply.status_code == 200, reply.text


#: Beside ``properties`` outlines ignores the ``$ref`` and compiles the rest; jsonschema then failed on the
#: answer (a 503 once the worker had answered).
_SHAPE = {"type": "object", "properties": {"x": {"type": "string", "maxLength": 3}}, "required": ["x"]}


@pytest.mark.parametrize(
    "ref", ["#/properties/x/type", "#/required", "#/properties/x/maxLength"], ids=["string", "list", "number"]
)
def test_a_ref_to_something_that_is_not_a_schema_is_refused_at_request_time(
    guided: ServerThread, upstream: FakeUpstream, ref: str
) -> None:
    upstream.behavior.text = '{"x": "a"}'
    reply = _chat(guided, **_schema({**_SHAPE, "$ref": ref}))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_guided_request", "response_format")
    assert "not a schema" in error["message"]
    assert upstream.requests == []


def _forced(parameters: Any, choice: str = "named") -> dict[str, Any]:
    """Two tools, the second's ``parameters`` given; ``tool_choice`` names it, or is "required" (the worker
    then decodes the call under a schema built from both tools' schemas)."""
    tools = [
        {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "f", "parameters": parameters}},
    ]
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "f"}}
    return {"tools": tools, "tool_choice": tool_choice}


# Refused in response_format by test_schema_bombs; the same refusal for a forced tool's parameters.
TOOL_BOMBS = [
    {"type": "object", "properties": {"s": {"type": "string", "pattern": "(a|b)*a(a|b){24}"}}},  # 2**24 states
    {"type": "array", "items": {"type": "integer"}, "minItems": 100_000},
    {"type": "object", "properties": {"s": {"type": "string", "pattern": "(?=a)a"}}},
    {**_SHAPE, "$ref": "#/properties/x/type"},
]


@pytest.mark.parametrize("choice", ["named", "required"])
@pytest.mark.parametrize("parameters", TOOL_BOMBS, ids=["dfa-blowup", "min-items", "lookahead", "ref-to-string"])
def test_a_forced_tool_schema_is_refused_as_the_same_response_format_schema_is(
    guided: ServerThread, upstream: FakeUpstream, parameters: dict[str, Any], choice: str
) -> None:
    as_tool = _chat(guided, **_forced(parameters, choice))  # first: compiled for the tool, not in the cache
    as_format = _chat(guided, **_schema(parameters))
    assert as_format.status_code == as_tool.status_code == 400, (as_format.text, as_tool.text)
    expected, got = as_format.json()["error"], as_tool.json()["error"]
    assert got["param"] == "tools[1].function.parameters"
    assert (got["type"], got["code"]) == (expected["type"], expected["code"])
    assert got["message"] == expected["message"].replace("'response_format'", "'tools[1].function.parameters'")
    assert upstream.requests == []


@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_tool_with_a_sound_schema_goes_to_the_worker_unchanged(
    guided: ServerThread, upstream: FakeUpstream, choice: str
) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    fields = _forced(schema, choice)
    upstream.behavior.tool_calls = [{"id": "call_1", "name": "f", "arguments": '{"city": "Paris"}'}]
    reply = _chat(guided, **fields)
    assert reply.status_code == 200, reply.text
    sent = upstream.requests[-1].body
    assert (sent["tools"], sent["tool_choice"]) == (fields["tools"], fields["tool_choice"])
    assert "structured_outputs" not in sent  # the worker builds the call's constraint from the tool itself
