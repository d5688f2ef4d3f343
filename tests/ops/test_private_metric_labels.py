"""Private labels (``Metrics.mark_private``): the public rendering sums them away, the admin's keeps
them; in one process and across processes (``PROMETHEUS_MULTIPROC_DIR``, which prometheus_client reads
once at import, hence a child process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client import Counter

from gateway.ops.metrics import Metrics

SCRIPT = """
from prometheus_client import Counter
from gateway.ops.metrics import Metrics
m = Metrics()
c = Counter("gateway_demo", "demo", ["tenant", "reason"], registry=m.registry)
m.mark_private(c, labels=("tenant",))
for tenant, reason, n in (("acme", "limit", 2), ("globex", "limit", 3), ("acme", "key", 1)):
    c.labels(tenant, reason).inc(n)
print(m.render().decode())
print("----")
print(m.render(private=True).decode())
"""


def check(public: str, full: str) -> None:
    assert "acme" not in public and "globex" not in public and "tenant=" not in public
    assert 'gateway_demo_total{reason="limit"} 5.0' in public
    assert 'gateway_demo_total{reason="key"} 1.0' in public
    assert 'gateway_demo_total{reason="limit",tenant="acme"} 2.0' in full
    assert 'gateway_demo_total{reason="limit",tenant="globex"} 3.0' in full


def test_private_labels_are_summed_away_in_the_public_rendering() -> None:
    metrics = Metrics()
    counter = Counter("gateway_demo", "demo", ["tenant", "reason"], registry=metrics.registry)
    metrics.mark_private(counter, labels=("tenant",))
    for tenant, reason, n in (("acme", "limit", 2), ("globex", "limit", 3), ("acme", "key", 1)):
        counter.labels(tenant, reason).inc(n)
    check(metrics.render().decode(), metrics.render(private=True).decode())


def test_private_labels_across_processes(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True).stdout
    public, full = out.split("----")
    check(public, full)
