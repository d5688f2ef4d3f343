"""The process's open-files limit against the connections the front door admits: one concept apart from
the protocol (``front_door``), applied once at start-up by ``gateway serve``."""

from __future__ import annotations

import contextlib
import logging

log = logging.getLogger("gateway.front_door")  # the name its warning has always had


def raise_open_files_limit(max_connections: int) -> None:
    """Each connection is a file descriptor (and a proxied request a second one, to its worker): raise
    the soft limit towards the hard one when it is too low for ``max_connections``, and say so when
    even the hard limit is (new connections then fail at accept, before the 503 can be sent)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return
    needed = 2 * max_connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        if soft < needed:
            log.warning(
                "open files limit %d is below what %d connections need (%d): lower GATEWAY_MAX_CONNECTIONS",
                soft,
                max_connections,
                needed,
            )
