"""Drain before shutdown: on SIGTERM, report not-ready first, keep serving, then let the server stop.

uvicorn's own SIGTERM handling closes the listening socket at once and then waits for in-flight
requests. A load balancer (a Kubernetes Service, an ingress) learns that a replica is going away only
from its readiness probe or from refused connections, so without a pause new requests still race
towards a socket that is about to close. With ``GATEWAY_DRAIN_DELAY_S`` > 0 the first SIGTERM only sets
``state.draining`` (``GET /ready`` answers 503 ``draining``) while everything else goes on being
served; after the delay the signal is handed to the server, which stops accepting, lets in-flight
requests and streams finish (its graceful-shutdown timeout) and runs the lifespan shutdown. This is the
``preStop: sleep`` pattern done in the process, so it also works where no preStop hook exists. A second
SIGTERM (or SIGINT) during the delay stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from gateway.server.state import AppState

log = logging.getLogger("gateway")


def install_sigterm_drain(state: AppState, delay_s: float) -> Callable[[], None] | None:
    """Put the drain in front of the SIGTERM handler the server installed; returns a function that
    restores it, or None when there is nothing to do (no delay, not the main thread, no handler)."""
    if delay_s <= 0 or threading.current_thread() is not threading.main_thread():
        return None  # signals reach only the main thread (an in-process test server has none)
    server_handler: Any = signal.getsignal(signal.SIGTERM)
    if not callable(server_handler):
        return None  # no server handler to hand over to (default or ignored): leave it alone
    loop = asyncio.get_running_loop()

    def on_sigterm(sig: int, frame: FrameType | None) -> None:
        if state.draining:
            server_handler(sig, frame)  # asked twice: stop now
            return
        state.draining = True
        log.info("SIGTERM: draining for %.1f s (readiness 503, still serving), then shutting down", delay_s)
        loop.call_soon_threadsafe(loop.call_later, delay_s, server_handler, sig, None)

    signal.signal(signal.SIGTERM, on_sigterm)

    def restore() -> None:
        if signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, server_handler)

    return restore
