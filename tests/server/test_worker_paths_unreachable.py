"""No endpoint of a vLLM worker that is not meant for clients is reachable through the gateway.

The gateway forwards the inference paths (chat, completions, embeddings) and vLLM's model-addressed
routes (rerank, score, classify, pooling, audio: tests/server/test_model_routes.py) to workers; everything
else is answered by the gateway itself. Each worker-only path, in every method and a few spellings, gets an
OpenAI-shaped 404/405 from the gateway (a spelling with dot segments a 400 ``invalid_path``:
gateway/server/paths.py), and the fake worker records no request at all.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tests.server.test_admin_access import raw_request
from tests.support.fakes import FakeUpstream

# vLLM 0.32's OpenAI server routes that only an operator or the engine's own tooling should call.
WORKER_ONLY = [
    "/invocations",
    "/pause",
    "/resume",
    "/is_paused",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/collective_rpc",
    "/update_weights",
    "/init_weight_transfer_engine",
    "/update_weights_from_disk",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/reset_encoder_cache",
    "/scale_elastic_ep",
    "/is_scaling_elastic_ep",
    "/server_info",
    "/start_profile",
    "/stop_profile",
    # (/v1/responses is the gateway's own: translated to chat completions, never forwarded; see
    # tests/server/test_responses_api.py. /v1/audio/*, /v1/rerank, /rerank, /score, /pooling and /classify
    # are routed by model behind the pipeline: tests/server/test_model_routes.py, test_audio_routes.py)
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/inference/v1/generate",
    "/get_world_size",
    "/ping",
]
# /tokenize, /detokenize and /version are the gateway's own routes (tests/server/test_utility_routes.py).
SPELLINGS = ["{p}", "/v1{p}", "{p}/", "//{p}", "/v1/chat/completions/..{p}", "/v1/../{p}", "/%2e%2e{p}"]


@pytest.mark.parametrize("path", WORKER_ONLY)
def test_worker_only_paths_are_not_forwarded(gateway: Any, upstream: FakeUpstream, path: str) -> None:
    for spelling in SPELLINGS:
        target = spelling.format(p=path).replace("///", "//")
        for method in ("GET", "POST", "PUT", "DELETE"):
            status, payload = raw_request(gateway.port, method, target, {"Content-Type": "application/json"}, b"{}")
            error = orjson.loads(payload)["error"]
            assert set(error) == {"message", "type", "param", "code"}
            if "/." in target or "%2e" in target:
                assert (status, error["code"]) == (400, "invalid_path"), (method, target, status, payload[:200])
            else:
                assert status in (404, 405), (method, target, status, payload[:200])
    assert upstream.requests == []


def test_the_gateways_own_metrics_are_not_the_workers(gateway: Any, upstream: FakeUpstream) -> None:
    status, payload = raw_request(gateway.port, "GET", "/metrics", {})
    assert status == 200
    assert b"gateway_" in payload and b"vllm:" not in payload
    assert upstream.requests == []
