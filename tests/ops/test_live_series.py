"""The console's time series: sampled on a timer into fixed rings, bounded in points, models and workers."""

from __future__ import annotations

import asyncio

import pytest

from gateway.ops.metrics import Metrics
from gateway.ops.series import MODEL_FIELDS, LiveSeries


def make(points: int = 4, max_models: int = 2, max_workers: int = 2) -> tuple[Metrics, LiveSeries, list[float]]:
    now = [1000.0]
    metrics = Metrics()
    in_flight = {"http://w1": 3}
    series = LiveSeries(
        metrics,
        lambda: dict(in_flight),
        interval_s=5,
        points=points,
        max_models=max_models,
        max_workers=max_workers,
        clock=lambda: now[0],
    )
    return metrics, series, now


def test_each_tick_records_the_figures_since_the_previous_one() -> None:
    metrics, series, now = make()
    series.tick()  # the starting point: nothing recorded yet
    assert series.as_json()["t"] == []
    for _ in range(10):
        metrics.requests.labels("m1", "chat/completions", "200").inc()
        metrics.ttft.labels("m1").observe(0.05)
    metrics.requests.labels("m1", "chat/completions", "429").inc(5)
    metrics.tokens.labels("m1", "completion").inc(100)
    metrics.upstream_errors.labels("http://w1", "connect").inc(5)
    now[0] += 5
    series.tick()
    now[0] += 5
    series.tick()  # a quiet interval

    body = series.as_json()
    assert body["t"] == [1005.0, 1010.0]
    m1 = body["models"]["m1"]
    assert m1["requests_per_s"] == [pytest.approx(3.0), 0.0]
    assert m1["errors_per_s"] == [pytest.approx(1.0), 0.0]
    assert m1["refusals_per_s"] == [pytest.approx(1.0), 0.0]
    assert m1["tokens_per_s"] == [pytest.approx(20.0), 0.0]
    assert 0.025 < m1["ttft_p50_s"][0] <= 0.05
    assert m1["ttft_p50_s"][1] is None  # no observation in that interval
    assert m1["cache_hit_rate"] == [None, None]
    assert set(m1) == set(MODEL_FIELDS)
    w1 = body["workers"]["http://w1"]
    assert w1 == {"in_flight": [3.0, 3.0], "errors_per_s": [pytest.approx(1.0), 0.0]}


def test_the_ring_keeps_the_last_points_only_oldest_first() -> None:
    metrics, series, now = make(points=4)
    series.tick()
    for i in range(1, 8):
        metrics.requests.labels("m1", "chat/completions", "200").inc(5 * i)
        now[0] += 5
        series.tick()
    body = series.as_json()
    assert body["t"] == [1020.0, 1025.0, 1030.0, 1035.0]
    assert body["models"]["m1"]["requests_per_s"] == [4.0, 5.0, 6.0, 7.0]
    assert len(series.models["m1"].values) == 4 * len(MODEL_FIELDS)  # allocated once, never grown


def test_models_and_workers_past_the_cap_are_named_not_stored() -> None:
    metrics, series, now = make(max_models=2, max_workers=1)
    series.workers_in_flight = lambda: {"http://w1": 0, "http://w2": 1}
    series.tick()
    for name in ("a", "b", "c", "d"):
        metrics.requests.labels(name, "chat/completions", "200").inc()
    now[0] += 5
    series.tick()
    body = series.as_json()
    assert sorted(body["models"]) == ["a", "b"]
    assert sorted(body["workers"]) == ["http://w1"]
    assert body["dropped"] == ["c", "d", "http://w2"]
    for name in range(10):
        metrics.requests.labels(f"more-{name}", "chat/completions", "200").inc()
    now[0] += 5
    series.tick()
    assert len(series.dropped) == 2 + 1  # the names of what was dropped are bounded too


def test_a_model_gone_quiet_leaves_a_gap_not_its_old_value() -> None:
    metrics, series, now = make()
    series.tick()
    metrics.in_flight.labels("m1").set(4)
    now[0] += 5
    series.tick()
    metrics.in_flight.labels("m1").set(2)
    now[0] += 5
    series.tick()
    assert series.as_json()["models"]["m1"]["in_flight"] == [4.0, 2.0]
    series.workers_in_flight = dict
    now[0] += 5
    series.tick()
    body = series.as_json()
    assert body["t"][-1] == now[0]
    assert body["workers"]["http://w1"]["in_flight"] == [3.0, 3.0, None]


def test_a_worker_gone_for_the_whole_window_gives_its_place_to_a_new_one() -> None:
    """Pods replaced by a rollout come back at new addresses: a gone worker's ring is freed once its
    window holds nothing, so the cap does not fill with dead workers and newcomers are charted."""
    _, series, now = make(points=3, max_workers=1)
    series.tick()
    for _ in range(3):
        now[0] += 5
        series.tick()
    series.workers_in_flight = lambda: {"http://w2": 1}  # w1 replaced by w2
    now[0] += 5
    series.tick()
    assert series.as_json()["dropped"] == ["http://w2"]  # w1's window still shows it
    for _ in range(2):
        now[0] += 5
        series.tick()
    body = series.as_json()
    assert sorted(body["workers"]) == ["http://w2"]
    assert body["workers"]["http://w2"]["in_flight"] == [None, None, 1.0]
    assert body["dropped"] == []


async def test_a_failed_sample_does_not_stop_the_timer() -> None:
    _, series, _ = make()
    calls: list[int] = []
    third = asyncio.Event()
    original = series.tick

    def flaky() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("a multiprocess file mid-write")
        original()
        if len(calls) >= 3:
            third.set()

    series.tick = flaky  # type: ignore[method-assign]
    series.interval_s = 0.001
    series.start()
    try:
        await asyncio.wait_for(third.wait(), timeout=10)
    finally:
        await series.aclose()
    assert series._task is None
