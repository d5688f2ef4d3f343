"""Capability check: does a worker enforce ``structured_outputs``?

vLLM ignores request fields it does not know, so a worker of another version (or one started without
structured outputs) would answer a guided request with free text and a 200. Before the first guided
request goes to a worker, it gets one tiny constrained request whose only acceptable answers are two
strings no model would write unprompted; the worker honours constraints iff it answers one of them.

A positive result is kept for the worker's lifetime in the table; a negative one is re-checked after
``probe_recheck_s`` (the worker may be replaced). A probe that cannot reach the worker records nothing:
the routing and health machinery deal with unreachable workers, and the next guided request probes again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from gateway.upstream.client import UpstreamClient, UpstreamFailure

PROBE_CHOICES = ["gw-probe-Qx7v", "gw-probe-Zk2m"]


@dataclass(frozen=True, slots=True)
class Capability:
    honours: bool
    detail: str
    checked_at: float


def probe_body(endpoint: str, served_model: str) -> bytes:
    body: dict[str, object] = {
        "model": served_model,
        "max_tokens": 12,
        "temperature": 0,
        "structured_outputs": {"choice": PROBE_CHOICES},
    }
    if endpoint == "completions":
        body["prompt"] = "Answer:"
    else:
        body["messages"] = [{"role": "user", "content": "Answer with one word."}]
    return orjson.dumps(body)


class CapabilityTable:
    """What each worker URL was found to do; shared across reloads via ``services.shared``."""

    def __init__(self) -> None:
        self._known: dict[str, Capability] = {}
        self._pending: dict[str, asyncio.Task[Capability | None]] = {}

    def get(self, url: str) -> Capability | None:
        return self._known.get(url)

    def snapshot(self) -> dict[str, Capability]:
        return dict(self._known)

    async def check(
        self,
        upstream: UpstreamClient,
        urls: list[str],
        *,
        endpoint: str,
        served_model: str,
        timeout_s: float,
        recheck_s: float,
    ) -> dict[str, Capability]:
        """Probe (concurrently, once each) the workers not known yet; return what is known of ``urls``."""
        now = time.monotonic()
        waits = []
        for url in urls:
            known = self._known.get(url)
            if known is not None and (known.honours or now - known.checked_at < recheck_s):
                continue
            task = self._pending.get(url)
            if task is None:
                task = asyncio.create_task(self._probe(upstream, url, endpoint, served_model, timeout_s))
                self._pending[url] = task
                task.add_done_callback(self._forget(url))
            waits.append(asyncio.shield(task))
        if waits:
            await asyncio.gather(*waits)
        return {url: self._known[url] for url in urls if url in self._known}

    def _forget(self, url: str) -> Callable[[object], None]:
        def forget(_task: object) -> None:
            self._pending.pop(url, None)

        return forget

    async def _probe(
        self, upstream: UpstreamClient, url: str, endpoint: str, served_model: str, timeout_s: float
    ) -> Capability | None:
        path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
        try:
            async with asyncio.timeout(timeout_s):
                response = await upstream.open(url, path, probe_body(endpoint, served_model))
                body = await response.read()
        except (TimeoutError, UpstreamFailure):
            return None  # unreachable or busy: nothing learnt
        if response.status >= 500:
            return None
        result = _judge(response.status, body)
        self._known[url] = result
        return result


def _judge(status: int, body: bytes) -> Capability:
    now = time.monotonic()
    if status != 200:
        return Capability(False, f"it refused a structured_outputs request (HTTP {status})", now)
    try:
        choice = orjson.loads(body)["choices"][0]
        text = choice.get("message", {}).get("content") if "message" in choice else choice.get("text")
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
        return Capability(False, "it answered a structured_outputs request with an unexpected body", now)
    if text in PROBE_CHOICES:
        return Capability(True, "enforces structured_outputs", now)
    return Capability(False, f"it ignored a structured_outputs choice constraint (answered {str(text)[:40]!r})", now)
