"""``gateway.ops.fast_metrics.fast_child``: the hot ``inc`` / ``dec`` / ``observe`` that reach into
prometheus_client's children (their ``_value``, ``_sum``, ``_buckets``, ``_upper_bounds``). Each case runs
the same operations through prometheus_client's own methods on one registry and through the fast children
on another, and compares the whole exposition: when prometheus_client changes those internals, this fails
here instead of counting wrong in production. Also in multiprocess mode, whose value class differs."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gateway.ops.fast_metrics import CachedLabels, fast_child
from gateway.ops.metrics import LATENCY_BUCKETS

OBSERVED = [0.0, 0.0004, 0.001, 0.0010001, 0.0025, 0.3, 1, 2.5, 7, 300, 301, math.inf, 1e9]


def _metrics(registry: CollectorRegistry) -> tuple[Counter, Gauge, Histogram]:
    counter = Counter("c", "c", ["a"], registry=registry)
    gauge = Gauge("g", "g", ["a"], registry=registry)
    histogram = Histogram("h", "h", ["a"], buckets=LATENCY_BUCKETS, registry=registry)
    return counter, gauge, histogram


def _drive(counter: object, gauge: object, histogram: object, wrap: object) -> None:
    c, g, h = (wrap(m.labels("x")) for m in (counter, gauge, histogram))  # type: ignore[attr-defined, operator]
    c.inc()
    c.inc(2.5)
    c.inc(0)
    g.inc()
    g.inc(3)
    g.dec()
    g.dec(0.5)
    for amount in OBSERVED:
        h.observe(amount)


def _exposition(wrap: object) -> bytes:
    registry = CollectorRegistry()
    _drive(*_metrics(registry), wrap=wrap)
    return b"\n".join(line for line in generate_latest(registry).splitlines() if b"_created" not in line)


def test_fast_children_count_what_prometheus_client_counts() -> None:
    assert _exposition(fast_child) == _exposition(lambda child: child)


def test_in_process_children_take_the_values_lock_themselves() -> None:
    """In one process the fast children add to prometheus_client's ``MutexValue`` under its lock without
    calling its ``inc`` (the case above compares what they count); the lock is the value's own, so a
    reader holding it (the exposition) sees no half-done update."""
    counter, gauge, histogram = _metrics(CollectorRegistry())
    children = [fast_child(m.labels("x")) for m in (counter, gauge, histogram)]
    assert [type(c).__name__ for c in children] == ["_InProcessCounter", "_InProcessGauge", "_InProcessHistogram"]
    value = counter.labels("x")._value
    assert value._lock.acquire(blocking=False)
    try:
        worker = threading.Thread(target=children[0].inc, args=(2,))
        worker.start()
        worker.join(timeout=0.2)
        assert worker.is_alive() and value._value == 0  # waits for the lock
    finally:
        value._lock.release()
    worker.join(timeout=5)
    assert value.get() == 2


def test_a_histogram_observation_waits_for_the_lock_its_values_share() -> None:
    """A histogram's child adds to its sum and its bucket under one lock, the one its values share once
    wrapped: a reader holding it (the exposition, reading any bucket) sees the observation whole or not
    at all, and the exposition still reads every value (no lock is taken twice)."""
    registry = CollectorRegistry()
    histogram = Histogram("h", "h", ["a"], buckets=(1, 2), registry=registry)
    raw = histogram.labels("x")
    child = fast_child(raw)
    bucket = raw._buckets[1]
    assert bucket._lock is raw._sum._lock
    assert bucket._lock.acquire(blocking=False)
    try:
        worker = threading.Thread(target=child.observe, args=(1.5,))
        worker.start()
        worker.join(timeout=0.2)
        assert worker.is_alive() and raw._sum._value == 0 and bucket._value == 0  # waits for the lock
    finally:
        bucket._lock.release()
    worker.join(timeout=5)
    assert (raw._sum.get(), bucket.get()) == (1.5, 1)
    exposition = generate_latest(registry)
    assert b'h_bucket{a="x",le="2.0"} 1.0' in exposition and b'h_sum{a="x"} 1.5' in exposition


def test_a_negative_counter_increment_is_refused_as_by_prometheus_client() -> None:
    counter = Counter("c", "c", ["a"], registry=CollectorRegistry())
    with pytest.raises(ValueError, match="non-negative"):
        fast_child(counter.labels("x")).inc(-1)
    assert counter.labels("x")._value.get() == 0


def test_nan_lands_in_no_bucket_as_with_prometheus_client() -> None:
    def buckets(wrap: object) -> list[bytes]:
        registry = CollectorRegistry()
        histogram = Histogram("h", "h", ["a"], buckets=(1, 2), registry=registry)
        wrap(histogram.labels("x")).observe(math.nan)  # type: ignore[operator]
        return [line for line in generate_latest(registry).splitlines() if b"_bucket" in line]

    assert buckets(fast_child) == buckets(lambda child: child)


def test_cached_labels_hand_out_fast_children_and_the_rest_of_the_child() -> None:
    counter = CachedLabels(Counter("c", "c", ["a"], registry=CollectorRegistry()))
    child = counter.labels("x")
    assert child is counter.labels("x")
    child.inc(4)
    assert child._value.get() == 4  # other attributes are the child's
    assert counter.labels("x").child is counter.metric.labels("x")


def test_a_removed_label_set_starts_a_new_series_and_not_the_forgotten_child() -> None:
    """A label set removed (a worker gone) and used again (it came back) counts into the registry: the
    cached child, which no scrape reads any more, is forgotten with the metric's."""
    registry = CollectorRegistry()
    counter = CachedLabels(Counter("c", "c", ["worker", "kind"], registry=registry))
    counter.labels("w1", "connect").inc(3)
    counter.labels("w2", "connect").inc()
    counter.remove("w1", "connect")
    assert registry.get_sample_value("c_total", {"worker": "w1", "kind": "connect"}) is None
    assert registry.get_sample_value("c_total", {"worker": "w2", "kind": "connect"}) == 1
    counter.labels("w1", "connect").inc()
    assert registry.get_sample_value("c_total", {"worker": "w1", "kind": "connect"}) == 1


def test_gauges_in_the_mostrecent_mode_keep_prometheus_clients_methods(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        from prometheus_client import CollectorRegistry, Gauge
        from gateway.ops.fast_metrics import fast_child
        gauge = Gauge("g", "g", ["a"], registry=CollectorRegistry(), multiprocess_mode="mostrecent")
        child = gauge.labels("x")
        assert fast_child(child) is child
        print("ok")
        """
    )
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_multiprocess_values_count_the_same(tmp_path: Path) -> None:
    """With ``PROMETHEUS_MULTIPROC_DIR`` set, children hold memory-mapped values: the files the fast
    children write add up (``MultiProcessCollector``) to what prometheus_client's methods write."""
    code = textwrap.dedent(
        """
        import sys
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector
        sys.path.insert(0, {tests!r})
        from test_fast_metrics import _drive, _metrics
        from gateway.ops.fast_metrics import fast_child
        wrap = fast_child if sys.argv[1] == "fast" else (lambda child: child)
        _drive(*_metrics(CollectorRegistry()), wrap=wrap)
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        sys.stdout.write(generate_latest(registry).decode())
        """
    ).format(tests=str(Path(__file__).parent))
    outputs = []
    for mode in ("fast", "plain"):
        folder = tmp_path / mode
        folder.mkdir()
        env = {"PROMETHEUS_MULTIPROC_DIR": str(folder), "PATH": ""}
        out = subprocess.run([sys.executable, "-c", code, mode], env=env, capture_output=True, text=True, check=True)
        # each run is another process; the collector's order of families is not fixed
        outputs.append(sorted(re.sub(r'pid="\d+"', 'pid="-"', out.stdout).splitlines()))
    assert outputs[0] == outputs[1]
    assert 'h_bucket{a="x",le="+Inf"} 13.0' in outputs[0]
    assert 'c_total{a="x"} 3.5' in outputs[0]
