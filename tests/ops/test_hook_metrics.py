"""Hook timings: every call counted under its own label set, with the labelled child cached."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from gateway.ops.metrics import Metrics


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_each_hook_call_is_counted_under_its_labels() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    for _ in range(3):
        metrics.observe_hook("cache", "on_request", "ok", 0.002)
    metrics.observe_hook("cache", "on_request", "error", 0.5)
    metrics.observe_hook("safety", "on_request", "ok", 0.001)
    name = "gateway_plugin_hook_duration_seconds_count"
    assert sample(registry, name, plugin="cache", hook="on_request", outcome="ok") == 3
    assert sample(registry, name, plugin="cache", hook="on_request", outcome="error") == 1
    assert sample(registry, name, plugin="safety", hook="on_request", outcome="ok") == 1
    sums = "gateway_plugin_hook_duration_seconds_sum"
    total = sample(registry, sums, plugin="cache", hook="on_request", outcome="ok")
    assert total is not None and abs(total - 0.006) < 1e-9
    # 0.5 s falls in the 0.5 bucket, not in a smaller one.
    bucket = "gateway_plugin_hook_duration_seconds_bucket"
    assert sample(registry, bucket, plugin="cache", hook="on_request", outcome="error", le="0.5") == 1
    assert sample(registry, bucket, plugin="cache", hook="on_request", outcome="error", le="0.25") == 0


def test_cached_labels_reuse_one_child_per_label_set_and_pass_everything_else_through() -> None:
    from prometheus_client import Counter

    from gateway.ops.fast_metrics import CachedLabels

    registry = CollectorRegistry()
    counter = CachedLabels(Counter("gwtest_things", "things", ["model", "reason"], registry=registry))
    counter.labels("m", "a").inc()
    counter.labels("m", "a").inc(2)
    counter.labels("m", "b").inc()
    assert counter.labels("m", "a") is counter.labels("m", "a")
    assert sample(registry, "gwtest_things_total", model="m", reason="a") == 3
    assert sample(registry, "gwtest_things_total", model="m", reason="b") == 1
    assert counter.describe()[0].name == "gwtest_things"  # the wrapped metric's own API
