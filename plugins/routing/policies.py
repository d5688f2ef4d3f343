"""Choosing one worker from a model's pool: round robin, least outstanding requests, and consistent
hashing with bounded loads (used for prefix affinity and session affinity).

Every policy takes the workers already tried by this request (a retry never returns to them) and skips
workers that are unhealthy or ejected. Load is the gateway's own ``Worker.in_flight`` counter (exact,
kept by the core), optionally plus a bias from the worker's scraped /metrics (``LoadBias``).

Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018): a key maps to a point on
a ring of virtual nodes and walks clockwise to the first worker whose load is below
``max(ceil(c * mean), ceil(mean + slack))``, where ``mean = (total + 1) / n``. A key keeps its worker
while that worker is not overloaded, so vLLM's prefix cache on it keeps hitting; a hot key spills to the
next workers on the ring instead of queueing.

The slack is an absolute allowance (like the absolute threshold of SGLang's cache-aware router): with
few requests in flight, ``c * mean`` is only a request or two above the mean (2 workers, 4 in flight:
a cap of 3), so a prefix would leave its home as soon as the home held 3 of 4 requests. Such small
imbalances cost a vLLM worker little (it batches them), while a spilled request misses the prefix
cache and, when the cache is full, evicts one of the other worker's own prefixes.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Sequence

from gateway.upstream.workers import Worker

#: Extra load per worker from outside the gateway (e.g. the worker's own queue); 0.0 when unknown.
LoadBias = Callable[[Worker], float]
_VNODES = 64


def stable_hash(data: bytes) -> int:
    """A hash that is the same in every gateway replica and process (``hash()`` is salted per process),
    so replicas agree on which worker holds a prefix."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class WorkerPool:
    """The workers of one model at one worker-table generation, with its hash ring built once."""

    __slots__ = ("_owners", "_points", "_rr", "workers")

    def __init__(self, workers: Sequence[Worker]) -> None:
        self.workers = list(workers)
        self._rr = 0
        ring = sorted(
            (stable_hash(f"{w.url}#{v}".encode()), i) for i, w in enumerate(self.workers) for v in range(_VNODES)
        )
        self._points = [p for p, _ in ring]
        self._owners = [i for _, i in ring]

    def __len__(self) -> int:
        return len(self.workers)

    def any_available(self, now: float) -> bool:
        return any(w.available(now) for w in self.workers)

    # -- policies ---------------------------------------------------------------------------------

    def round_robin(self, tried: Sequence[Worker], now: float) -> Worker | None:
        workers = self.workers
        n = len(workers)
        start = self._rr
        self._rr = (start + 1) % n if n else 0
        for offset in range(n):
            worker = workers[(start + offset) % n]
            if worker.available(now) and worker not in tried:
                return worker
        return None

    def least_outstanding(self, tried: Sequence[Worker], now: float, bias: LoadBias | None = None) -> Worker | None:
        """The available worker with the fewest requests in flight; ties go round robin so an idle
        pool is still spread evenly."""
        workers = self.workers
        n = len(workers)
        start = self._rr
        self._rr = (start + 1) % n if n else 0
        best: Worker | None = None
        best_load = math.inf
        # The hot loop of the busiest policy: availability is inlined (Worker.available) on purpose.
        for worker in workers[start:] + workers[:start]:
            if not worker.healthy or worker.ejected_until > now or (tried and worker in tried):
                continue
            load = worker.in_flight + bias(worker) if bias is not None else worker.in_flight
            if load < best_load:
                best, best_load = worker, load
        return best

    def hashed(
        self, key: int, load_factor: float, tried: Sequence[Worker], now: float, load_slack: int = 0
    ) -> Worker | None:
        """Consistent hashing with bounded loads: the first worker clockwise from ``key`` whose
        in-flight count is under ``load_factor`` x the mean (counting this request) or under the mean
        plus ``load_slack``, whichever is higher."""
        workers = self.workers
        if not workers:
            return None
        total = 0
        live = 0
        for worker in workers:
            if worker.healthy and worker.ejected_until <= now and not (tried and worker in tried):
                total += worker.in_flight
                live += 1
        if not live:
            return None
        mean = (total + 1) / live
        cap = max(math.ceil(load_factor * mean), math.ceil(mean + load_slack))
        points, owners = self._points, self._owners
        size = len(points)
        start = bisect.bisect_left(points, key)
        seen = 0
        fallback: Worker | None = None
        for step in range(size):
            worker = workers[owners[(start + step) % size]]
            if not worker.available(now) or worker in tried:
                continue
            if worker.in_flight < cap:
                return worker
            if fallback is None or worker.in_flight < fallback.in_flight:
                fallback = worker
            seen += 1
            if seen >= live * 4:  # every live worker has been met (with high probability) and is at cap
                break
        return fallback


def prompt_prefix(endpoint: str, body: dict[str, object], chars: int) -> str:
    """The part of a prompt that requests are expected to share, at most ``chars`` characters.

    Chat: the leading system/developer messages (the shared system prompt vLLM caches); without one,
    the start of the first message. Completions and embeddings: the start of the prompt/input.
    """
    if endpoint == "chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return ""
        parts: list[str] = []
        size = 0
        for message in messages:
            if not isinstance(message, dict) or message.get("role") not in ("system", "developer"):
                break
            text = _text_of(message.get("content"))
            parts.append(text)
            size += len(text)
            if size >= chars:
                break
        if not parts:
            first = messages[0]
            parts.append(_text_of(first.get("content")) if isinstance(first, dict) else "")
        return "\n".join(parts)[:chars]
    value = body.get("prompt" if endpoint == "completions" else "input")
    if isinstance(value, list) and value:
        value = value[0]
    if isinstance(value, list):  # token ids
        return ",".join(str(t) for t in value[: chars // 4])
    return value[:chars] if isinstance(value, str) else ""


def _text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""
