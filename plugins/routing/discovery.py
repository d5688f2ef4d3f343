"""Discovery of workers behind DNS names: ``dns://name:port`` worker refs resolve to every address the
name has (a Kubernetes headless Service has one A/AAAA record per ready pod), re-resolved periodically.

Resolved addresses feed the core's ``WorkerTable`` (``set_discovered``), which health checks them like
any other worker; static URLs and managed workers need no discovery. A failed lookup keeps the last
known addresses (a DNS hiccup must not empty a pool). The resolver is injectable so tests control it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import urlsplit

from gateway.ops.tasks import cancel_and_wait
from gateway.upstream.workers import WorkerTable

log = logging.getLogger("gateway.routing.discovery")

#: (host, port) -> the addresses it resolves to, as IP strings.
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def system_resolver(host: str, port: int) -> list[str]:
    """The system resolver through the event loop's thread pool (never blocks the loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def parse_dns_ref(ref: str) -> tuple[str, int]:
    parts = urlsplit(ref)
    if parts.scheme != "dns" or not parts.hostname or parts.port is None:
        raise ValueError(f"worker ref '{ref}' must look like dns://name:port")
    return parts.hostname, parts.port


def worker_url(address: str, port: int) -> str:
    host = f"[{address}]" if isinstance(ipaddress.ip_address(address), ipaddress.IPv6Address) else address
    return f"http://{host}:{port}"


class DnsDiscovery:
    """Keeps the worker table's view of every ``dns://`` ref current."""

    def __init__(
        self,
        workers: WorkerTable,
        refs: Iterable[str],
        *,
        interval_s: float,
        timeout_s: float,
        resolver: Resolver = system_resolver,
        live: Callable[[], bool] = lambda: True,
    ) -> None:
        """``live`` says whether the config these refs come from is the live one: only then does a round
        forget the refs it does not name, and the background rounds run at all (the first, at ``start``,
        resolves this config's refs before it may go live, and forgets nothing the live one uses)."""
        self.workers = workers
        self.live = live
        self.refs = sorted({ref for ref in refs if ref.startswith("dns://")})
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.resolver = resolver
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> None:
        """Resolve every ref once (concurrently, each bounded) and update the table; when ``live``, first
        forget the refs that are not this config's."""
        if self.live():
            self.workers.retain_discovered(self.refs)
        results = await asyncio.gather(*(self._resolve(ref) for ref in self.refs))
        for ref, urls in zip(self.refs, results, strict=True):
            if urls is not None and self.workers.set_discovered(ref, urls):
                log.info("%s now resolves to %s", ref, ", ".join(urls) or "nothing")

    async def _resolve(self, ref: str) -> list[str] | None:
        host, port = parse_dns_ref(ref)
        try:
            async with asyncio.timeout(self.timeout_s):
                addresses = await self.resolver(host, port)
        except Exception as exc:
            log.warning("could not resolve %s (%s); keeping the last known workers", ref, exc or type(exc).__name__)
            return None
        return [worker_url(a, port) for a in sorted(set(addresses))]

    def retain(self) -> None:
        """This config went live: forget the discovered refs that it does not name."""
        self.workers.retain_discovered(self.refs)

    async def start(self) -> None:
        if not self.refs:
            return
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="routing-dns-discovery")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if not self.live():  # not yet live, or retired and draining: the live config's rounds keep the table
                continue
            try:
                await self.refresh()
            except Exception:  # a bug here must not end discovery for good
                log.exception("DNS discovery round failed")

    async def aclose(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
