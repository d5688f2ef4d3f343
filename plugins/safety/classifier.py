"""The optional model-based check: ask a guard model served by an OpenAI-compatible worker (e.g. a
Llama Guard behind vLLM) whether a prompt is safe.

The prompt text is sent as one user message with ``temperature: 0`` and a few output tokens; a reply
that matches ``unsafe_pattern`` (RE2) is a hit. The call has its own time budget; a timeout, transport
failure or unreadable reply is an error, handled by ``on_error``: ``fail_closed`` refuses the request
with 503, ``fail_open`` lets it go on (counted and logged). It uses the gateway's pooled upstream
client, so no connection is opened per request.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

import orjson

from gateway.upstream.client import UpstreamClient, UpstreamFailure
from gateway.wire.errors import ServiceUnavailable
from plugins.safety.config import ClassifierConfig
from plugins.safety.detectors import compile_re2

log = logging.getLogger("gateway.safety")
Verdict = Literal["safe", "unsafe", "error", "timeout"]


class Classifier:
    def __init__(self, config: ClassifierConfig, upstream: UpstreamClient) -> None:
        self.config = config
        self._upstream = upstream
        self._unsafe: Any = compile_re2(config.unsafe_pattern)
        self._url = config.url.rstrip("/")

    async def classify(self, text: str) -> Verdict:
        cfg = self.config
        body = orjson.dumps(
            {
                "model": cfg.model,
                "messages": [{"role": "user", "content": text[-cfg.max_chars :]}],
                "max_tokens": 8,
                "temperature": 0,
            }
        )
        try:
            async with asyncio.timeout(cfg.timeout_ms / 1000):
                response = await self._upstream.open(self._url, "/v1/chat/completions", body)
                raw = await response.read()
        except TimeoutError:
            return "timeout"
        except UpstreamFailure as failure:
            log.warning("safety classifier at %s failed: %s", self._url, failure.error.message)
            return "error"
        if response.status != 200:
            log.warning("safety classifier at %s answered HTTP %s", self._url, response.status)
            return "error"
        try:
            reply = orjson.loads(raw)["choices"][0]["message"]["content"] or ""
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            log.warning("safety classifier at %s sent an unreadable reply", self._url)
            return "error"
        return "unsafe" if self._unsafe.search(reply) else "safe"

    def unavailable(self, verdict: Verdict) -> ServiceUnavailable:
        what = "did not answer in time" if verdict == "timeout" else "failed"
        return ServiceUnavailable(
            f"The safety classifier {what}; the request was not sent (fail_closed). Try again shortly.",
            code="safety_check_unavailable",
        )
