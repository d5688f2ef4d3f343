"""Mid-stream failover with two real vLLM CPU workers: streams are running on both when one worker is
SIGKILLed (with its engine core) after ~40 chunks. Every stream finishes with ``[DONE]`` and no error
event, keeps one ``id``, counts the request's prompt exactly, and at temperature 0 its text is the
uninterrupted answer's (bounded as a similarity: docs/failover.md says how close the runs came).

The workers are the package's ``two_workers`` (tests/e2e/conftest.py); the killed one is restarted by
the engine supervisor, and the test waits for it so that later tests get both workers back.
"""

from __future__ import annotations

import difflib
import json
import logging
import threading
from typing import Any

import httpx
import orjson
import pytest

from tests.e2e.conftest import TwoWorkers
from tests.support.gateways import ENGINE_MODEL, GatewayFactory
from tests.support.processes import kill_worker

pytestmark = pytest.mark.engine

BODY: dict[str, Any] = {
    "model": ENGINE_MODEL,
    "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}],
    "max_tokens": 120,
    "temperature": 0,
}
STREAMS = 4
KILL_AFTER = 40


def config(urls: list[str]) -> dict[str, Any]:
    return {
        "models": [{"name": ENGINE_MODEL, "workers": urls}],
        "plugins": [{"name": "routing", "config": {"default": {"policy": "least_outstanding"}}}],
        "upstream": {"first_byte_timeout_s": 300, "idle_timeout_s": 60, "health_interval_s": 1},
    }


def stream(url: str, index: int, out: dict[int, list[Any]], started: threading.Event, count: list[int]) -> None:
    events: list[Any] = []
    body = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"x-request-id": f"failover-{index}"}
    with (
        httpx.Client(timeout=600) as http,
        http.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            events.append(data if data == "[DONE]" else orjson.loads(data))
            count[0] += 1
            if count[0] >= KILL_AFTER:
                started.set()
    out[index] = events


def text_of(events: list[Any]) -> str:
    return "".join(
        (c["choices"][0]["delta"].get("content") or "") for c in events if isinstance(c, dict) and c.get("choices")
    )


def test_a_killed_worker_costs_the_streams_nothing(
    gateway_factory: GatewayFactory, two_workers: TwoWorkers, caplog: pytest.LogCaptureFixture
) -> None:
    if not two_workers.managed:
        pytest.skip("kills a worker: only with workers this test session manages (and restarts)")
    two_workers.wait_healthy(900)
    caplog.set_level(logging.INFO, logger="gateway.access")
    with gateway_factory(config(list(two_workers))) as (_, gw), httpx.Client(timeout=600) as http:
        reference = http.post(gw.url + "/v1/chat/completions", json=BODY).json()
        expected = reference["choices"][0]["message"]["content"]
        if reference["usage"]["completion_tokens"] < KILL_AFTER + 20:
            pytest.skip("the model's answer is too short to be cut midway")
        results: dict[int, list[Any]] = {}
        started = threading.Event()
        counts = [[0] for _ in range(STREAMS)]
        readers = [
            threading.Thread(target=stream, args=(gw.url, i, results, started, counts[i])) for i in range(STREAMS)
        ]
        for reader in readers:
            reader.start()
        assert started.wait(600), "no stream reached the kill point"
        kill_worker(two_workers[0])
        for reader in readers:
            reader.join(timeout=600)
    access = {
        r.fields["request_id"]: r.fields for r in caplog.records if r.name == "gateway.access" and hasattr(r, "fields")
    }
    resumed = {i for i in range(STREAMS) if access.get(f"failover-{i}", {}).get("resumed_from") == two_workers[0]}
    assert len(results) == STREAMS
    assert resumed, "the kill landed on no stream in flight"
    report = []
    for i, events in sorted(results.items()):
        assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
        chunks = events[:-1]
        assert not [c for c in chunks if "error" in c], chunks
        assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
        assert [f for f in finishes if f] == [reference["choices"][0]["finish_reason"]]
        assert sum(1 for c in chunks if c.get("choices") and "role" in c["choices"][0]["delta"]) == 1
        # The usage counts what the client received, the prompt once: the continuation did not start over.
        usage = chunks[-1]["usage"]
        assert usage["prompt_tokens"] == reference["usage"]["prompt_tokens"]
        assert abs(usage["completion_tokens"] - reference["usage"]["completion_tokens"]) <= 2, usage
        text = text_of(chunks)
        assert text.count(text[:40]) == 1, text  # its opening once: the resumption did not start over
        report.append((i in resumed, round(difflib.SequenceMatcher(None, text, expected).ratio(), 3), text))
    print(f"\n(resumed, similarity to the uninterrupted answer) per stream: {[r[:2] for r in report]}")
    # Temperature 0: the same answer as the uninterrupted one (float32 workers, see conftest.py; a near-tie
    # token flipped by the batch's numerics would make the texts part from there, hence a ratio, not ==).
    assert all(similarity >= 0.75 for _, similarity, _ in report), (report, expected)
    two_workers.wait_healthy(900)


def test_vllm_starts_a_json_schema_over_after_an_assistant_prefill(two_workers: TwoWorkers) -> None:
    """Why a guided-JSON stream is not continued: vLLM accepts the prefill with the same response_format,
    but applies the grammar to the generated tokens only, so the continuation is a whole new object."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    messages = [{"role": "user", "content": "Invent a person; answer as JSON with name, age and city."}]
    base = {"model": ENGINE_MODEL, "messages": messages, "temperature": 0, "max_tokens": 80}
    url = two_workers[-1] + "/v1/chat/completions"
    with httpx.Client(timeout=300) as http:
        whole = http.post(url, json={**base, "response_format": response_format}).json()["choices"][0]["message"]
        prefix = whole["content"][: len(whole["content"]) // 2]
        prefill = {
            **base,
            "messages": [*messages, {"role": "assistant", "content": prefix}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        }
        guided = http.post(url, json={**prefill, "response_format": response_format})
        free = http.post(url, json=prefill)
    assert guided.status_code == 200 and free.status_code == 200
    continued = guided.json()["choices"][0]["message"]["content"]
    json.loads(continued)  # a whole object of its own ...
    with pytest.raises(json.JSONDecodeError):
        json.loads(prefix + continued)  # ... so the prefix plus it is not JSON
    # Unconstrained, the same prefill continues the answer.
    assert prefix + free.json()["choices"][0]["message"]["content"] == whole["content"]
