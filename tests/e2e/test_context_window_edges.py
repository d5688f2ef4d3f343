"""Prompts at and over the context window, and enormous max_tokens, against a real vLLM worker.

The gateway leaves the context window to the engine (it knows the tokenised prompt length): a prompt
that fits with its max_tokens is served, one that does not is vLLM's 400 translated into OpenAI's
shape, never a 5xx. Token-id prompts make the length exact.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.gateways import RealEngine

pytestmark = pytest.mark.engine

WINDOW = 2048  # engine_config: max_model_len
TOKEN = 28  # any ordinary token id of SmolLM2's vocabulary


def _post(engine: RealEngine, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(engine.gateway_url + path, json={"model": engine.model, **body}, timeout=300)


def _assert_400(response: httpx.Response, *words: str) -> None:
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["code"] is None or isinstance(error["code"], str)
    message = error["message"].lower()
    assert any(word in message for word in words), message


def test_prompt_exactly_at_the_window_is_served(real_worker: RealEngine) -> None:
    response = _post(real_worker, "/v1/completions", {"prompt": [TOKEN] * (WINDOW - 4), "max_tokens": 4})
    assert response.status_code == 200, response.text[:500]
    assert response.json()["usage"]["prompt_tokens"] == WINDOW - 4


def test_max_tokens_past_the_window_is_cut_at_the_window(real_worker: RealEngine) -> None:
    """vLLM 0.32 serves a prompt that fits even when prompt + max_tokens does not: generation stops at
    the window with finish_reason 'length'. The gateway passes that through unchanged."""
    response = _post(
        real_worker, "/v1/completions", {"prompt": [TOKEN] * (WINDOW - 4), "max_tokens": 50, "ignore_eos": True}
    )
    assert response.status_code == 200, response.text[:500]
    reply = response.json()
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] <= 4


@pytest.mark.parametrize(("prompt_tokens", "max_tokens"), [(WINDOW, 1), (WINDOW + 1, 1), (20_000, 1)])
def test_prompt_over_the_window_is_a_400_in_openai_shape(
    real_worker: RealEngine, prompt_tokens: int, max_tokens: int
) -> None:
    response = _post(real_worker, "/v1/completions", {"prompt": [TOKEN] * prompt_tokens, "max_tokens": max_tokens})
    _assert_400(response, "context", "maximum", "length", "tokens")


def test_chat_prompt_far_over_the_window_is_a_400(real_worker: RealEngine) -> None:
    messages = [{"role": "user", "content": "lorem ipsum dolor " * 3000}]
    _assert_400(
        _post(real_worker, "/v1/chat/completions", {"messages": messages, "max_tokens": 8}),
        "context",
        "maximum",
        "length",
        "tokens",
    )


def test_streamed_prompt_over_the_window_is_a_400_before_any_event(real_worker: RealEngine) -> None:
    body = {"prompt": [TOKEN] * (WINDOW + 10), "max_tokens": 1, "stream": True}
    _assert_400(_post(real_worker, "/v1/completions", body), "context", "maximum", "length", "tokens")


@pytest.mark.parametrize("max_tokens", [2**31, 2**63 - 1])
def test_enormous_max_tokens_is_a_400_from_the_engine(real_worker: RealEngine, max_tokens: int) -> None:
    response = _post(
        real_worker, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    )
    _assert_400(response, "context", "maximum", "max_tokens", "length", "tokens")


def test_the_worker_still_serves_after_all_of_it(real_worker: RealEngine) -> None:
    response = _post(
        real_worker, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    )
    assert response.status_code == 200
