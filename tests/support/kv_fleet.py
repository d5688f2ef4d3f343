"""Fake workers that publish KV cache events: each a ``FakeUpstream`` served on loopback and a
``ThreadedPublisher`` on real ZMQ sockets, for tests that route by those events through a real gateway."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.kv_publisher import ThreadedPublisher


def kv_workers(
    stack: contextlib.ExitStack, count: int = 2
) -> tuple[list[FakeUpstream], list[ServerThread], list[ThreadedPublisher]]:
    """``count`` fake workers (``w0``, ``w1``, ...), their servers and their publishers (``kv@w0``, ...),
    in that order; all of them closed when ``stack`` closes."""
    fakes = [FakeUpstream(name=f"w{i}") for i in range(count)]
    servers = [stack.enter_context(ServerThread(f)) for f in fakes]
    pubs = [ThreadedPublisher(f"kv@w{i}") for i in range(count)]
    for pub in pubs:
        stack.callback(pub.close)
    return fakes, servers, pubs


def kv_sources(servers: Sequence[ServerThread], pubs: Sequence[ThreadedPublisher]) -> dict[str, dict[str, Any]]:
    """The routing config's ``kv_events.sources``: each server's URL to its publisher's sockets."""
    return {s.url: {"endpoint": p.source.endpoint, "replay_endpoint": p.source.replay_endpoint,
                    "topic": p.source.topic} for s, p in zip(servers, pubs, strict=True)}  # fmt: skip
