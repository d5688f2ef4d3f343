"""The console's live figures come from the metric objects: rates and percentiles over a window."""

from __future__ import annotations

import pytest

from gateway.ops.metrics import Metrics
from gateway.ops.stats import LiveStats, quantile


def test_quantile_interpolates_inside_the_bucket() -> None:
    buckets = [(0.1, 0.0), (0.2, 50.0), (0.4, 100.0), (float("inf"), 100.0)]
    assert quantile(buckets, 0.5) == pytest.approx(0.2)
    assert quantile(buckets, 0.75) == pytest.approx(0.3)
    assert quantile(buckets, 0.25) == pytest.approx(0.15)
    assert quantile([(0.1, 0.0), (float("inf"), 0.0)], 0.5) is None
    assert quantile([(0.1, 0.0), (float("inf"), 4.0)], 0.99) == 0.1  # beyond the last bound


def test_rates_and_percentiles_cover_only_the_window() -> None:
    now = [100.0]
    metrics = Metrics()
    stats = LiveStats(metrics, window_s=10, clock=lambda: now[0])
    for _ in range(50):
        metrics.requests.labels("m1", "chat/completions", "200").inc()
        metrics.latency.labels("m1", "chat/completions").observe(3.0)
    metrics.requests.labels("m1", "chat/completions", "429").inc(10)
    metrics.tokens.labels("m1", "completion").inc(600)
    now[0] = 102.0
    first = stats.sample()["models"]["m1"]
    assert first["requests_per_s"] == pytest.approx(30.0)
    assert first["errors_per_s"] == pytest.approx(5.0)
    assert first["tokens_per_s"] == pytest.approx(300.0)
    assert 2.5 < first["latency_p50_s"] <= 5

    # Later requests are fast: the window shows them, not the slow ones from before it.
    now[0] = 104.0
    for _ in range(20):
        metrics.requests.labels("m1", "chat/completions", "200").inc()
        metrics.latency.labels("m1", "chat/completions").observe(0.002)
    second = stats.sample()
    m1 = second["models"]["m1"]
    assert second["window_s"] == pytest.approx(2.0)
    assert m1["requests_per_s"] == pytest.approx(10.0)
    assert m1["errors_per_s"] == 0
    assert m1["latency_p99_s"] <= 0.0025
    assert m1["ttft_p50_s"] is None
    assert m1["cache_hit_rate"] is None


def test_cache_hits_and_safety_refusals_are_read_from_plugin_metrics() -> None:
    from prometheus_client import Counter

    now = [0.0]
    metrics = Metrics()
    hits = Counter("gateway_cache_hits", "", ["model"], registry=metrics.registry)
    misses = Counter("gateway_cache_misses", "", ["model"], registry=metrics.registry)
    rules = Counter("gateway_safety_rule_hits", "", ["rule", "action", "direction"], registry=metrics.registry)
    stats = LiveStats(metrics, clock=lambda: now[0])
    hits.labels("m1").inc(3)
    misses.labels("m1").inc(1)
    rules.labels("pii", "block", "input").inc(4)
    rules.labels("pii", "redact", "input").inc(9)
    now[0] = 2.0
    report = stats.sample()
    assert report["models"]["m1"]["cache_hit_rate"] == pytest.approx(0.75)
    assert report["safety_refusals_per_s"] == pytest.approx(2.0)


def test_statuses_counted_by_class_are_errors_too() -> None:
    now = [0.0]
    metrics = Metrics()
    stats = LiveStats(metrics, clock=lambda: now[0])
    metrics.requests.labels("m1", "chat/completions", "200").inc(6)
    metrics.requests.labels("m1", "chat/completions", "4xx").inc(2)  # a worker's 418 (``STATUS_LABELS``)
    metrics.requests.labels("m1", "chat/completions", "404").inc(2)
    now[0] = 2.0
    m1 = stats.sample()["models"]["m1"]
    assert m1["requests_per_s"] == pytest.approx(5.0)
    assert m1["errors_per_s"] == pytest.approx(2.0)


def test_polling_faster_than_the_window_keeps_a_bounded_number_of_samples() -> None:
    """A caller polling every millisecond for 30 s of the stats' clock: at most 11 samples are held (one
    per tenth of the 10 s window, and the newest), and each answer still covers the last window."""
    now = [0.0]
    metrics = Metrics()
    stats = LiveStats(metrics, window_s=10, clock=lambda: now[0])
    most = 0
    for step in range(30_000):
        now[0] = step / 1000
        metrics.requests.labels("m1", "chat/completions", "200").inc()
        report = stats.sample()
        most = max(most, len(stats._samples))
    assert most <= 11
    assert 9.0 <= report["window_s"] <= 10.0
    assert report["models"]["m1"]["requests_per_s"] == pytest.approx(1000.0, rel=0.01)
