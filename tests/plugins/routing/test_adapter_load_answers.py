"""What the adapter loader makes of a worker's answer to a load: only vLLM's own "has already been loaded"
for the adapter asked for counts as a load done; any other refusal is the loader's 502, whatever words it
contains. (vLLM's own answer counting as done is pinned through the gateway, by
test_an_adapter_another_gateway_evicted_is_loaded_again_instead_of_a_404.)"""

from __future__ import annotations

import socket

import orjson
import pytest

from gateway.engine.spec import LoraSettings
from gateway.ops.metrics import Metrics
from gateway.pipeline.adapters import AdapterConfig
from gateway.upstream.workers import Worker
from gateway.wire.errors import GatewayError
from plugins.routing.adapter_loader import AdapterLoader
from tests.upstream.test_client_against_scripted_workers import Answer, client, raw_worker


def vllm_400(message: str) -> Answer:
    """A 400 in vLLM's error shape (``create_error_response``) carrying ``message``."""
    body = orjson.dumps({"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}})

    def answer(conn: socket.socket, head: bytes) -> bool:
        conn.sendall(
            b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        conn.sendall(body)
        return True

    return answer


async def load(answer: Answer, adapter: AdapterConfig) -> Worker:
    """``ensure`` the adapter on a worker that answers the load with ``answer``; the worker, as the
    gateway then sees it (raises what ``ensure`` raises)."""
    upstream = client()
    try:
        with raw_worker(answer) as server:
            worker = Worker(url=server.url)
            try:
                await AdapterLoader(upstream, Metrics()).ensure(worker, adapter, LoraSettings())
            finally:
                assert not worker.adapters.loading
            return worker
    finally:
        await upstream.aclose()


@pytest.mark.parametrize(
    ("adapter", "message"),
    [
        # vLLM's refusal of an adapter named as a base model, for an adapter whose name says "already"
        (
            AdapterConfig(name="already", path="/a/already"),
            "The lora adapter 'already' conflicts with a served base model.",
        ),
        # a refusal that quotes the adapter's path
        (AdapterConfig(name="sql", path="/a/already-tuned"), "Invalid LoRA adapter config at /a/already-tuned"),
        # vLLM's words for another adapter than the one asked for
        (AdapterConfig(name="sql", path="/a/sql"), "The lora adapter 'sql-v0' has already been loaded."),
    ],
    ids=["name", "path", "other-adapter"],
)
async def test_a_refusal_that_mentions_already_is_not_a_load_done(adapter: AdapterConfig, message: str) -> None:
    with pytest.raises(GatewayError) as refused:
        await load(vllm_400(message), adapter)
    assert (refused.value.status_code, refused.value.code) == (502, "adapter_load_failed")
    assert message in refused.value.message  # the worker's words, to say what to fix
