"""Checking precise placement against the truth: each response's ``usage.prompt_tokens_details.cached_tokens``
(what the worker reused from its prefix cache) against the tokens the index predicted it would.

A model whose recent share of predictions within one block falls below the threshold is *degraded*:
its tokenization or block hashes have drifted from the workers' (another chat template, hash seed or
block size), or events are being lost. Routing then places its requests by approximate affinity, goes
on predicting and checking, and returns to precise placement once the share is back above the
threshold (with a margin, so a model at the edge does not flap).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

log = logging.getLogger("gateway.routing.placement")

_RECOVER_MARGIN = 0.05


class AccuracyTracker:
    """One model's recent predictions: a window of within-one-block outcomes and the degraded flag."""

    __slots__ = ("checked", "degraded", "min_samples", "model", "threshold", "window")

    def __init__(self, model: str, *, window: int, min_samples: int, threshold: float) -> None:
        self.model = model
        self.window: deque[bool] = deque(maxlen=window)
        self.min_samples = min_samples
        self.threshold = threshold
        self.degraded = False
        self.checked = 0

    def configure(self, *, window: int, min_samples: int, threshold: float) -> None:
        if self.window.maxlen != window:
            self.window = deque(self.window, maxlen=window)
        self.min_samples, self.threshold = min_samples, threshold

    def share(self) -> float | None:
        """The share of recent predictions within one block of the truth (None before ``min_samples``)."""
        n = len(self.window)
        return sum(self.window) / n if n >= self.min_samples and n else None

    def observe(self, predicted: int, actual: int, block_size: int) -> bool:
        """Record one checked request; returns whether it was within one block."""
        within = abs(predicted - actual) <= block_size
        self.window.append(within)
        self.checked += 1
        share = self.share()
        if share is None:
            return within
        if not self.degraded and share < self.threshold:
            self.degraded = True
            log.warning(
                "model %s: only %.0f%% of the last %d cache predictions were within one block of the worker's "
                "cached_tokens; placing by approximate prefix affinity until they recover (check the tokenizer, "
                "chat template, hash algorithm, seed and block size against the workers')",
                self.model, 100 * share, len(self.window),
            )  # fmt: skip
        elif self.degraded and share >= min(self.threshold + _RECOVER_MARGIN, 1.0):
            self.degraded = False
            log.info("model %s: cache predictions agree with the workers again (%.0f%%)", self.model, 100 * share)
        return within

    def mark(self, reason: str) -> None:
        """Degrade at once, for a mismatch seen directly (a worker's block hashes are not ours)."""
        if not self.degraded:
            log.error("model %s: %s; placing by approximate prefix affinity", self.model, reason)
        self.degraded = True


def reported_cached_tokens(usage: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` when the worker reported it."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    cached = details.get("cached_tokens")
    return cached if isinstance(cached, int) and cached >= 0 else None
