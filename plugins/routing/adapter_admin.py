"""Operator actions on LoRA adapters, served at ``POST /admin/plugins/routing/{action}``.

- ``adapters`` ``{}``: every worker of a model with adapters and what it holds (name, held or loading,
  pinned, requests using it, seconds since last use).
- ``pin_adapter`` ``{"adapter", "worker"}``: load the adapter on that worker now if it is not there, and
  keep it there: a pinned adapter is never the one evicted to make room.
- ``unpin_adapter`` ``{"adapter", "worker"}``: let it be evicted again when least recently used.
- ``unload_adapter`` ``{"adapter", "worker"}``: unload it from that worker now (pinned or not); refused
  with a 409 while requests are using it there. The next request for it loads it again somewhere.

``adapter`` is an adapter's name or alias, ``worker`` the URL of a worker of its base model (as
``GET /admin/workers`` lists them). ``unpin_adapter`` and ``unload_adapter`` also take an adapter the live
config does not give that worker (removed by a reload, its base model moved to other workers, loaded by
another gateway): by the name the worker holds it under, on any worker the gateway knows that holds it.

A load or unload that fails on the way to the worker is the loader's error (502 ``adapter_load_failed``,
504 ``adapter_load_timeout``), never a 500: the request path retries that failure elsewhere, an action on
one named worker cannot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from gateway.pipeline.adapters import LoraSettings
from gateway.pipeline.config import AdapterModel
from gateway.upstream.client import UpstreamFailure
from gateway.upstream.workers import Worker
from gateway.wire.errors import BadGateway, GatewayError, GatewayTimeout, InvalidRequest, NotFound
from plugins.routing.adapter_loader import AdapterLoader

log = logging.getLogger("gateway.routing.adapters")

ACTIONS = ("adapters", "pin_adapter", "unpin_adapter", "unload_adapter")


class AdapterAdmin:
    """The actions above over one config's adapters (``names``: every name and alias)."""

    def __init__(
        self,
        names: dict[str, AdapterModel],
        lora: dict[str, LoraSettings],
        lora_of: Callable[[Worker, str], LoraSettings],
        workers_of: Callable[[str], Sequence[Worker]],
        loader: Callable[[], AdapterLoader],
        every_worker: Callable[[], Sequence[Worker]],
    ) -> None:
        self._names = names
        self._lora = lora
        self._lora_of = lora_of
        self._workers_of = workers_of
        self._loader = loader
        self._every_worker = every_worker

    async def handle(self, action: str, body: dict[str, Any]) -> dict[str, Any]:
        """Run ``action``; its result, or a ``GatewayError`` the admin API answers in the OpenAI shape. A
        worker that cannot be reached, is too slow or answers garbage is a 502 ``adapter_load_failed``
        (504 ``adapter_load_timeout`` for a timeout) naming the worker, as the loader's own errors are:
        on the request path the same failure is retried on another worker, here there is no other."""
        if action == "adapters":
            return self.overview()
        model, worker, name = self._target(action, body)
        try:
            return await self._act(action, body, model, worker, name)
        except UpstreamFailure as failure:
            raise worker_failed(action, name, worker.url, failure) from None

    async def _act(
        self, action: str, body: dict[str, Any], model: AdapterModel | None, worker: Worker, name: str
    ) -> dict[str, Any]:
        state = worker.adapters
        if action == "pin_adapter":
            assert model is not None  # a pin loads the adapter: _target finds it in the config or refuses
            # Pinned from before the load is awaited: a load queued behind it on the worker runs before this
            # resumes, and must not evict it.
            was_pinned = name in state.pinned
            state.pinned.add(name)
            try:
                await self._loader().ensure(worker, model.adapter, self._lora_of(worker, model.base))
            except BaseException:
                if not was_pinned:
                    state.pinned.discard(name)
                raise
        elif action == "unpin_adapter":
            state.pinned.discard(name)
        else:
            loader = self._loader()
            async with loader.holding(worker.url):
                # Counted once the lock is held: a request may have begun while a load held it.
                busy = state.active.get(name, 0)
                if busy:
                    raise GatewayError(
                        f"Adapter '{body['adapter']}' is in use by {busy} request(s) on {worker.url}; try again when"
                        " they end.",
                        code="adapter_in_use",
                        status=409,
                    )
                await loader.unload(worker, name, "admin")
        return {"worker": worker.url, "adapters": state.describe(time.monotonic())}

    def overview(self) -> dict[str, Any]:
        now = time.monotonic()
        seen: dict[str, Worker] = {}
        for base in self._lora:
            for worker in self._workers_of(base):
                seen.setdefault(worker.url, worker)
        return {"workers": [{"url": url, "adapters": w.adapters.describe(now)} for url, w in seen.items()]}

    def _target(self, action: str, body: dict[str, Any]) -> tuple[AdapterModel | None, Worker, str]:
        """The adapter's config (None: one the live config does not give that worker), the worker, and the
        name the worker knows the adapter by."""
        name, url = body.get("adapter"), body.get("worker")
        if not isinstance(name, str) or not isinstance(url, str):
            raise InvalidRequest('Send {"adapter": NAME, "worker": URL}.', code="invalid_action_body")
        url = url.rstrip("/")
        model = self._names.get(name)
        if model is not None:
            worker = next((w for w in self._workers_of(model.base) if w.url == url), None)
            if worker is not None:
                return model, worker, model.upstream_name
        if action != "pin_adapter":
            # Letting go of an adapter needs no config: one a reload left on a worker still holds a slot there.
            served = model.upstream_name if model is not None else name
            for worker in self._every_worker():
                state = worker.adapters
                if worker.url == url and (state.holds(served) or served in state.pinned):
                    return None, worker, served
        if model is None:
            raise NotFound(f"No adapter '{name}' in the live config.", param="adapter", code="adapter_not_found")
        raise NotFound(
            f"'{url}' is not a worker of '{model.base}', the base model of '{model.name}'.",
            param="worker",
            code="worker_not_found",
        )


def worker_failed(action: str, name: str, url: str, failure: UpstreamFailure) -> GatewayError:
    """An admin action's load or unload that failed on the way to or from the worker (``failure``), as the
    error the operator gets. The admin API may name the worker (the public port never does)."""
    verb = "loaded on" if action == "pin_adapter" else "unloaded from"
    message = f"LoRA adapter '{name}' could not be {verb} {url}: {failure.error.message}"
    log.warning("%s of adapter %s on %s failed: %s", action, name, url, failure.error.message)
    if failure.kind == "timeout":
        return GatewayTimeout(message, code="adapter_load_timeout")
    return BadGateway(message, code="adapter_load_failed")
