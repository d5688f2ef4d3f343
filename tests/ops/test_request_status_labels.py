"""``gateway_requests_total``'s ``status`` label comes from a fixed set: a worker answering statuses of
its own invention passes them on to its clients but adds no series per status."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.ops.metrics import STATUS_LABELS
from tests.support.fakes import FakeUpstream, ServerThread

MESSAGES = [{"role": "user", "content": "hi"}]
ODD_STATUSES = (418, 420, 451, 460, 487)  # none the gateway answers itself or OpenAI documents


def requests_by_status(server: ServerThread, route: str) -> dict[str, float]:
    """The public ``gateway_requests_total`` series of ``route``, by their ``status`` label."""
    counts: dict[str, float] = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("gateway_requests_total{") and f'route="{route}"' in line:
            status = line.split('status="', 1)[1].split('"', 1)[0]
            counts[status] = float(line.rsplit(" ", 1)[1])
    return counts


@pytest.mark.parametrize(
    ("path", "route", "body"),
    [
        ("/v1/chat/completions", "chat/completions", {"messages": MESSAGES}),
        ("/v1/messages", "messages", {"messages": MESSAGES, "max_tokens": 8}),  # a translated turn
    ],
)
def test_a_worker_inventing_statuses_adds_one_class_series_not_one_per_status(
    gateway: ServerThread, upstream: FakeUpstream, path: str, route: str, body: dict[str, Any]
) -> None:
    for status in ODD_STATUSES:
        upstream.behavior.status = status
        assert httpx.post(gateway.url + path, json={"model": "m1", **body}).status_code == status  # passed on
    upstream.behavior.status = 409  # one OpenAI documents keeps its own series
    assert httpx.post(gateway.url + path, json={"model": "m1", **body}).status_code == 409

    assert requests_by_status(gateway, route) == {"4xx": len(ODD_STATUSES), "409": 1.0}


def test_the_statuses_the_gateway_answers_keep_their_own_label() -> None:
    for status in (200, 400, 401, 403, 404, 405, 408, 409, 413, 415, 422, 429, 499, 500, 502, 503, 504):
        assert STATUS_LABELS[status] == str(status)
    assert [STATUS_LABELS[s] for s in (201, 302, 418, 431, 599)] == ["2xx", "3xx", "4xx", "4xx", "5xx"]
    assert 418 not in STATUS_LABELS  # a miss is answered, not remembered
