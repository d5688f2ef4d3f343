"""Schema fuzzing with schemathesis: every operation of the gateway's own /openapi.json, with bodies
that fit the documented request models (positive) and bodies that break them (negative).

The gateway runs with the safety, cache (real Redis), guided_json and routing plugins in front of the
fake worker, so generated requests travel the whole request path. The fake worker never fails, so
every 5xx would be the gateway's own: none is allowed. Every 4xx must be in OpenAI's error shape and
carry ``x-request-id``, and the gateway must still serve afterwards. Bounded: a fixed number of
examples per operation and mode, no shrinking database, a timeout per request.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis.core.result import Ok

from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config

EXAMPLES = 60  # per operation and mode: 15 operations x 2 modes
MODES = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]


@pytest.fixture
def fuzz_gateway(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, tmp_path: Path
) -> Iterator[ServerThread]:
    namespace = "fuzz" + uuid.uuid4().hex[:12]
    plugins: list[dict[str, Any]] = [
        {"name": "safety", "config": {"rules": [{"id": "no-x", "kind": "words", "words": ["forbidden"]}]}},
        {"name": "cache", "config": {"namespace": namespace, "timeout_ms": 200}},
        {"name": "guided_json", "config": {"probe": False, "compile_timeout_ms": 500}},
        {"name": "routing"},
    ]
    responses = {"redis_prefix": f"test:{namespace}"}  # the Responses the fuzzer creates are stored here
    batches = {"redis_prefix": f"test:{namespace}:batch", "files_dir": str(tmp_path / "files")}  # and its files
    config = base_config([upstream_url], plugins=plugins, responses=responses, batches=batches)
    with gateway_factory(config) as (_, server):
        yield server
    client = redis.Redis()
    names = list(client.scan_iter(match=f"gwcache:{namespace}:*", count=1000))
    names += list(client.scan_iter(match=f"test:{namespace}:*", count=1000))
    if names:
        client.delete(*names)
    client.close()


def check_response(response: Any, label: str) -> None:
    status = response.status_code
    assert status < 500, f"{label}: {status} {response.text[:500]}"
    assert "x-request-id" in response.headers, label
    if status >= 400:
        body = response.json()
        assert set(body) == {"error"}, f"{label}: {body}"
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, f"{label}: {error}"
        assert isinstance(error["message"], str) and error["message"]
        assert error["type"] in ("invalid_request_error", "authentication_error", "permission_error"), error
        assert error["code"] is None or isinstance(error["code"], str)
        assert error["param"] is None or isinstance(error["param"], str)


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_schema_fuzz_no_5xx_and_openai_errors(fuzz_gateway: ServerThread, upstream: FakeUpstream, mode: Any) -> None:
    schema = schemathesis.openapi.from_url(fuzz_gateway.url + "/openapi.json")
    results = list(schema.get_all_operations())
    assert all(isinstance(result, Ok) for result in results), "the gateway's OpenAPI schema does not load"
    operations = [result.ok() for result in results if isinstance(result, Ok)]
    labels = sorted(op.label for op in operations)
    assert "POST /v1/chat/completions" in labels and "POST /v1/embeddings" in labels
    session_seen = {"requests": 0}
    statuses: Counter[str] = Counter()
    unsatisfiable: list[str] = []

    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode), known_model=st.sampled_from([True, True, True, False]))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def run(case: Any, known_model: bool) -> None:
            # Most bodies name a served model, so they get past the model lookup into the plugins.
            if known_model and isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = "m1"
            response = case.call(base_url=fuzz_gateway.url, timeout=15)
            session_seen["requests"] += 1
            statuses[f"{case.operation.label} {response.status_code}"] += 1
            check_response(response, f"{case.operation.label} {case.body!r:.300}")

        try:
            run()
        except Unsatisfiable:
            # An operation with no parameters and no body (GET /health) has no invalid input.
            unsatisfiable.append(operation.label)

    print(f"\nschemathesis {mode}: {session_seen['requests']} requests;", dict(sorted(statuses.items())))
    assert not [label for label in unsatisfiable if label.startswith("POST")]
    assert session_seen["requests"] >= len(operations)
    if mode == schemathesis.GenerationMode.POSITIVE:
        assert upstream.requests, "no generated request reached the worker: the fuzz tested only refusals"
    # Still serving after everything the fuzzer sent.
    ok = httpx.post(
        fuzz_gateway.url + "/v1/chat/completions", json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert ok.status_code == 200
