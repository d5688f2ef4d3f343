"""Reading a test gateway's metrics as the admin sees them (every series: by model, worker, tenant).

The public ``/metrics`` sums those labels away (``gateway.ops.metrics.ADMIN_ONLY_LABELS``); tests that
check a per-model or per-worker series read the admin view: from the registry the admin port renders,
for a gateway served in-process, or over HTTP with the admin token, for one in its own process.
"""

from __future__ import annotations

import httpx

from gateway.server.routes.health import render_metrics
from tests.support.fakes import ServerThread


def admin_metrics(server: ServerThread) -> str:
    """The admin view of the ``/metrics`` of an in-process gateway (``gateway_factory``)."""
    app = server.server.config.app  # the GatewayApp the factory served
    return render_metrics(app.state, private=True).decode()


def admin_scrape(url: str, token: str, *, timeout: float = 5, close: bool = False) -> str:
    """The admin view over HTTP: ``/metrics`` with the admin token (``close``: a fresh connection)."""
    headers = {"authorization": f"Bearer {token}", **({"connection": "close"} if close else {})}
    response = httpx.get(url + "/metrics", headers=headers, timeout=timeout)
    response.raise_for_status()
    return response.text
