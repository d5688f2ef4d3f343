"""Live figures for the operator console (``GET /admin/stats``), read from the metric objects themselves.

Nothing is scraped: ``LiveStats.sample()`` collects the families of ``Metrics`` (the registry every core
and plugin metric lives on, or the multiprocess files when several processes share them) and keeps a few
recent samples (at most ``per_window + 1``, however often it is called). Each answer compares the newest
sample with the oldest one inside ``window_s``, so rates (requests/s, tokens/s) and percentiles (TTFT,
latency, read from the histogram buckets' increase) describe the last few seconds, not the process's
lifetime. Before a second sample exists they are computed since start.

By model: requests/s, errors/s (status >= 400), refusals/s (status 429: rate limits, budgets, a full
queue), tokens/s, in-flight, queued, TTFT p50/p95/p99, latency
p50/p95/p99, cache hits and misses (the cache plugin's ``gateway_cache_*``). Safety refusals are counted
in total (block actions and limits): the safety plugin's metrics have no model label.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gateway.ops.metrics import Metrics

#: (family name, label values) -> value; histogram buckets keep their ``le`` as the last label value.
Totals = dict[tuple[str, tuple[str, ...]], float]

_COUNTED = (
    "gateway_requests",
    "gateway_tokens",
    "gateway_cache_hits",
    "gateway_cache_misses",
    "gateway_safety_rule_hits",
    "gateway_safety_limit_refusals",
    "gateway_upstream_errors",  # by worker: the workers view's errors/s (``gateway.ops.series``)
)
_GAUGES = ("gateway_in_flight_requests", "gateway_queued_requests")
_HISTOGRAMS = {"ttft": "gateway_time_to_first_token_seconds", "latency": "gateway_request_duration_seconds"}
_QUANTILES = (0.5, 0.95, 0.99)


@dataclass(slots=True)
class Sample:
    at: float
    totals: Totals = field(default_factory=dict)


def take_sample(metrics: Metrics, now: float) -> Sample:
    """The counters, gauges and histogram buckets the console shows, as one flat table."""
    sample = Sample(at=now)
    wanted_hist = set(_HISTOGRAMS.values())
    for family in metrics.collect():
        name = family.name
        if name in _COUNTED or name.removesuffix("_total") in _COUNTED:
            base = name.removesuffix("_total")
            for s in family.samples:
                if s.name.endswith("_total"):
                    _add(sample.totals, base, s.labels, s.value)
        elif name in _GAUGES:
            for s in family.samples:
                _add(sample.totals, name, s.labels, s.value)
        elif name in wanted_hist:
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    labels = {k: v for k, v in s.labels.items() if k != "le"}
                    key = (name, (*_ordered(name, labels), s.labels["le"]))
                    sample.totals[key] = sample.totals.get(key, 0.0) + s.value
    return sample


def _ordered(name: str, labels: dict[str, str]) -> tuple[str, ...]:
    # The model first wherever there is one: what the console groups by.
    model = labels.get("model")
    rest = tuple(v for k, v in sorted(labels.items()) if k != "model")
    return (model, *rest) if model is not None else rest


def _add(totals: Totals, name: str, labels: dict[str, str], value: float) -> None:
    key = (name, _ordered(name, labels))
    totals[key] = totals.get(key, 0.0) + value


def quantile(buckets: Iterable[tuple[float, float]], q: float) -> float | None:
    """The ``q`` quantile of cumulative ``(upper bound, count)`` buckets, interpolated inside the bucket
    it falls in (as Prometheus's ``histogram_quantile``); None without observations."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    total = ordered[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound  # beyond the last finite bound: the best we can say
            inside = count - lower_count
            fraction = (rank - lower_count) / inside if inside > 0 else 1.0
            return lower_bound + (bound - lower_bound) * fraction
        lower_bound, lower_count = bound, count
    return lower_bound


class LiveStats:
    """Keeps samples of the last ``window_s`` seconds and answers the console's figures.

    Bounded whatever the callers' pace: a sample is kept only when the newest kept one is at least
    ``window_s / per_window`` seconds old, so at most ``per_window + 1`` are held (each a flat table of
    every model's counters and histogram buckets). A caller polling faster than that gets figures
    measured from the oldest kept sample as before, and adds nothing."""

    def __init__(
        self,
        metrics: Metrics,
        *,
        window_s: float = 10.0,
        per_window: int = 10,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics = metrics
        self.window_s = window_s
        self.spacing_s = window_s / per_window
        self.clock = clock
        self._started = Sample(at=clock())
        # maxlen: the spacing already bounds it; a clock that jumps back must not undo that
        self._samples: deque[Sample] = deque(maxlen=per_window + 1)

    def sample(self) -> dict[str, Any]:
        now = self.clock()
        newest = take_sample(self.metrics, now)
        while self._samples and now - self._samples[0].at > self.window_s:
            self._samples.popleft()
        oldest = self._samples[0] if self._samples else self._started
        if not self._samples or now - self._samples[-1].at >= self.spacing_s:
            self._samples.append(newest)
        return report(oldest, newest)


def report(old: Sample, new: Sample) -> dict[str, Any]:
    """The figures between two samples, by model, plus the totals that have no model."""
    seconds = max(new.at - old.at, 1e-6)
    models, refusals = _tally(old, new)
    out = {model: _rates(entry, seconds) for model, entry in sorted(models.items())}
    return {"window_s": seconds, "models": out, "safety_refusals_per_s": refusals / seconds}


def _tally(old: Sample, new: Sample) -> tuple[dict[str, dict[str, Any]], float]:
    """Per model, the counts between two samples (gauges as they are now), and the safety refusals."""

    def delta(key: tuple[str, tuple[str, ...]]) -> float:
        return max(new.totals.get(key, 0.0) - old.totals.get(key, 0.0), 0.0)

    models: dict[str, dict[str, Any]] = {}

    def row(model: str) -> dict[str, Any]:
        return models.setdefault(
            model,
            {"requests": 0.0, "errors": 0.0, "refusals": 0.0, "tokens": 0.0, "in_flight": 0, "queued": 0,
             "cache_hits": 0.0, "cache_misses": 0.0, "buckets": {"ttft": {}, "latency": {}}},
        )  # fmt: skip

    refusals = 0.0
    for key, value in new.totals.items():
        name, labels = key
        if name == "gateway_requests":
            entry = row(labels[0])
            entry["requests"] += delta(key)
            if labels[-1][:1] in ("4", "5"):  # "404", or a class such as "4xx" (``STATUS_LABELS``)
                entry["errors"] += delta(key)
                entry["refusals"] += delta(key) if labels[-1] == "429" else 0.0
        elif name == "gateway_tokens":
            row(labels[0])["tokens"] += delta(key)
        elif name == "gateway_in_flight_requests":
            row(labels[0])["in_flight"] += int(value)
        elif name == "gateway_queued_requests":
            row(labels[0])["queued"] += int(value)
        elif name == "gateway_cache_hits":
            row(labels[0])["cache_hits"] += delta(key)
        elif name == "gateway_cache_misses":
            row(labels[0])["cache_misses"] += delta(key)
        elif name == "gateway_safety_rule_hits":
            if "block" in labels:
                refusals += delta(key)
        elif name == "gateway_safety_limit_refusals":
            refusals += delta(key)
        else:
            for kind, family in _HISTOGRAMS.items():
                if name == family:
                    bound = float(labels[-1])
                    buckets = row(labels[0])["buckets"][kind]
                    buckets[bound] = buckets.get(bound, 0.0) + delta(key)
    return models, refusals


def _rates(entry: dict[str, Any], seconds: float) -> dict[str, Any]:
    buckets = entry["buckets"]
    looked_up = entry["cache_hits"] + entry["cache_misses"]
    return {
        "requests_per_s": entry["requests"] / seconds,
        "errors_per_s": entry["errors"] / seconds,
        "refusals_per_s": entry["refusals"] / seconds,
        "tokens_per_s": entry["tokens"] / seconds,
        "in_flight": entry["in_flight"],
        "queued": entry["queued"],
        "cache_hit_rate": entry["cache_hits"] / looked_up if looked_up else None,
        **{
            f"{kind}_p{round(q * 100)}_s": quantile(buckets[kind].items(), q)
            for kind in _HISTOGRAMS
            for q in _QUANTILES
        },
    }
