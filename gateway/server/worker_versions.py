"""The vLLM version each worker reports, for the admin API (``GET /admin/versions``).

The workers' answers are kept for ``VERSION_TTL_S`` and fetched at most once at a time per worker, so
polling the route costs the workers nothing.
"""

from __future__ import annotations

import asyncio
import time

import orjson

from gateway.pipeline.services import Services
from gateway.server.state import AppState

VERSION_TTL_S = 60.0
VERSION_TIMEOUT_S = 2.0
_EXTRAS_KEY = "worker_versions"


async def model_versions(state: AppState) -> dict[str, str | None]:
    """Per model, the vLLM version(s) its workers report (None: none of them said)."""
    versions: WorkerVersions = state.extras.setdefault(_EXTRAS_KEY, WorkerVersions(state.services))
    models: dict[str, str | None] = {}
    if not state.holder.loaded:
        return models
    with state.holder.pin() as snapshot:
        table = snapshot.models
        by_model = {m.name: state.services.workers.expand(table.worker_urls[m.name]) for m in table.models}
    found = await versions.of({url for urls in by_model.values() for url in urls})
    for name, urls in by_model.items():
        known = sorted({v for url in urls if (v := found.get(url)) is not None})
        # Workers of one model on different vLLM versions (a rolling upgrade): name them all.
        models[name] = ", ".join(known) if known else None
    return models


class WorkerVersions:
    """The vLLM version each worker reports on its ``/version``, kept ``VERSION_TTL_S``; one fetch at a
    time per worker, each bounded by ``VERSION_TIMEOUT_S`` (an unreachable worker reads as unknown)."""

    def __init__(self, services: Services) -> None:
        self._services = services
        self._known: dict[str, tuple[float, str | None]] = {}
        self._fetching: dict[str, asyncio.Task[str | None]] = {}

    async def of(self, urls: set[str]) -> dict[str, str | None]:
        now = time.monotonic()
        stale = [u for u in urls if u not in self._known or now - self._known[u][0] > VERSION_TTL_S]
        if stale:
            tasks = [self._fetching.get(u) or self._start(u) for u in stale]
            # Shielded: a caller that goes away must not cancel a fetch other callers wait for.
            await asyncio.gather(*(asyncio.shield(t) for t in tasks))
        return {u: self._known[u][1] for u in urls if u in self._known}

    def _start(self, url: str) -> asyncio.Task[str | None]:
        task = asyncio.create_task(self._fetch(url), name=f"worker-version {url}")
        self._fetching[url] = task
        return task

    async def _fetch(self, url: str) -> str | None:
        found: str | None = None
        try:
            status, body = await self._services.upstream.get(url + "/version", timeout_s=VERSION_TIMEOUT_S)
            parsed = orjson.loads(body) if status == 200 else None
            if isinstance(parsed, dict) and isinstance(parsed.get("version"), str):
                found = parsed["version"][:64]
        except Exception:  # unreachable, timed out or not vLLM: the version is unknown
            found = None
        finally:
            self._known[url] = (time.monotonic(), found)
            self._fetching.pop(url, None)
        return found
