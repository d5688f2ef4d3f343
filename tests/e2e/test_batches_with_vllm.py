"""The Batch API end to end: the official openai SDK uploads a JSONL file, creates a batch, polls it and
downloads the output and errors; the lines are answered by the real vLLM CPU worker through the gateway's
pipeline, in-process; the batch lives in the real Redis."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.support.batches import batch_names, batches_section, chat_line, jsonl, parse_jsonl, wait_for
from tests.support.gateways import GatewayFactory, RealEngine

pytestmark = pytest.mark.engine
__all__ = ["batch_names"]


def test_the_sdk_runs_a_batch_on_vllm(
    real_worker: RealEngine, gateway_factory: GatewayFactory, batch_names: dict[str, Any]
) -> None:
    config = {
        "models": [{"name": real_worker.model, "workers": [real_worker.url], "max_model_len": 2048}],
        "plugins": [{"name": "routing"}],
        "upstream": {"first_byte_timeout_s": 300, "idle_timeout_s": 120},
        "batches": batches_section(batch_names, lease_s=30),
    }
    shared = "You are a terse assistant. Answer in one short sentence. "  # a shared prefix, run together
    lines: list[Any] = [
        chat_line(f"q-{i}", shared + question, model=real_worker.model, max_tokens=8, temperature=0)
        for i, question in enumerate(("What is 2+2?", "Name a colour.", "Say hi."))
    ]
    lines.append(
        {"custom_id": "c-0", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": real_worker.model, "messages": [{"role": "user", "content": "Count to three."}],
                  "max_tokens": 8, "temperature": 0}}
    )  # fmt: skip
    lines.append(chat_line("too-long", "hi", model=real_worker.model, max_tokens=100_000))  # the worker's 400
    lines.append(b'{"custom_id": "broken", ')
    with gateway_factory(config) as (_, server):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        source = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")  # fmt: skip
        done = wait_for(client, batch.id, ("completed", "failed"), timeout_s=600)
        assert done.status == "completed", done
        output = parse_jsonl(client.files.content(done.output_file_id or "").content)
        errors = parse_jsonl(client.files.content(done.error_file_id or "").content)
    answered = {line["custom_id"]: line["response"] for line in output}
    assert set(answered) == {"q-0", "q-1", "q-2", "c-0"}
    for response in answered.values():
        assert response["status_code"] == 200
        assert response["body"]["model"] == real_worker.model
        assert response["body"]["choices"][0]["message"]["content"]
        assert 0 < response["body"]["usage"]["completion_tokens"] <= 8
    refused = {line["custom_id"]: line for line in errors}
    assert set(refused) == {"too-long", None}
    assert refused["too-long"]["response"]["status_code"] == 400
    assert refused["too-long"]["response"]["body"]["error"]["type"] == "invalid_request_error"
    assert refused[None]["error"]["code"] == "invalid_json"
    assert done.request_counts is not None and done.usage is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (4, 2)
    assert done.usage.output_tokens == sum(r["body"]["usage"]["completion_tokens"] for r in answered.values())
