"""Memory the console's live series take, per model and per worker, measured with tracemalloc.

    .venv/bin/python bench/bench_series_memory.py [--models 32] [--workers 128]

Fills every ring of a ``LiveSeries`` with the defaults of ``create_app`` (5 s x 180 points = 15 minutes)
and prints the bytes traced per model and per worker, and the whole at the caps. What is measured is
everything the series holds: the rings, the dicts naming them and the previous metrics sample
(allocations still alive, from ``gateway/ops/series.py`` and ``gateway/ops/stats.py``).
"""

from __future__ import annotations

import argparse
import tracemalloc

from gateway.ops.metrics import Metrics
from gateway.ops.series import LiveSeries


def filled(models: int, workers: int) -> tuple[LiveSeries, list[float]]:
    now = [0.0]
    metrics = Metrics()
    in_flight = {f"http://10.0.0.{i}:8000": i for i in range(workers)}
    series = LiveSeries(metrics, lambda: in_flight, clock=lambda: now[0])
    for step in range(series.points + 1):
        for m in range(models):
            metrics.requests.labels(f"model-{m}", "chat/completions", "200").inc()
            metrics.ttft.labels(f"model-{m}").observe(0.01 * step)
            metrics.latency.labels(f"model-{m}", "chat/completions").observe(0.02 * step)
        now[0] += series.interval_s
        series.tick()
    return series, now


def traced(models: int, workers: int) -> int:
    """Bytes allocated for a filled series (and kept), less the metrics it reads from."""
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    series, _ = filled(models, workers)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    # What the series keeps: its rings (series.py) and the previous sample it compares with (stats.py);
    # the metric objects are the process's anyway.
    kept = after.filter_traces(
        [tracemalloc.Filter(True, "*gateway/ops/series.py"), tracemalloc.Filter(True, "*gateway/ops/stats.py")]
    )
    size = sum(stat.size for stat in kept.statistics("filename"))
    del series, before
    return size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", type=int, default=32)
    parser.add_argument("--workers", type=int, default=128)
    args = parser.parse_args()
    one_model = traced(1, 0)
    many_models = traced(args.models, 0)
    many_workers = traced(1, args.workers)
    per_model = (many_models - one_model) / (args.models - 1)
    per_worker = (many_workers - one_model) / args.workers
    print(f"one model, no worker:       {one_model:>10,} bytes")
    print(f"per model (of {args.models}):         {per_model:>10,.0f} bytes")
    print(f"per worker (of {args.workers}):       {per_worker:>10,.0f} bytes")
    print(f"at the caps ({args.models} models, {args.workers} workers): {traced(args.models, args.workers):,} bytes")


if __name__ == "__main__":
    main()
