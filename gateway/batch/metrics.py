"""The batch lane's Prometheus metrics, on the app's registry: lines done and failed (each line once, with
its final outcome, on the replica whose run or step made it final), lines waiting,
lines running on this replica, and tokens (a rate of ``gateway_batch_tokens_total`` is tokens/s)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from gateway.ops.metrics import Metrics


class BatchMetrics:
    def __init__(self, metrics: Metrics) -> None:
        r = metrics.registry
        self.lines = Counter(
            "gateway_batch_lines",
            "Batch lines run to their final outcome on this replica, each line once (completed: answered;"
            " failed: refused or errored)",
            ["outcome"],
            registry=r,
        )
        self.tokens = Counter(
            "gateway_batch_tokens",
            "Tokens of batch lines this replica ran, by kind (input, output)",
            ["kind"],
            registry=r,
        )
        self.queued = Gauge(
            "gateway_batch_queued_lines", "Lines of running batches not done yet (all replicas)", registry=r
        )
        self.deferred = Counter(
            "gateway_batch_lines_deferred",
            "Batch line runs refused for now (a rate limit) and given back to run after the wait",
            registry=r,
        )
        self.running = Gauge("gateway_batch_running_lines", "Batch lines in flight on this replica", registry=r)
        self.batches = Gauge("gateway_batch_active", "Batches not in a final state (all replicas)", registry=r)

    def line_final(self, outcome: str, n: int = 1) -> None:
        """``n`` lines whose outcome is final: counted once each, whichever run or step made it so (see
        ``gateway.batch.work.Recorded``). A line whose first run's error a second run's success replaced
        is one completed line, not a failed one and a completed one."""
        if n:
            self.lines.labels(outcome).inc(n)

    def run_tokens(self, tokens: tuple[int, int]) -> None:
        """The tokens of a run whose result was written."""
        if tokens[0]:
            self.tokens.labels("input").inc(tokens[0])
        if tokens[1]:
            self.tokens.labels("output").inc(tokens[1])
