"""The response cache: answer repeated deterministic requests from Redis, streamed or not.

On the way in (``on_request``) it decides whether the request may use the cache (``policy``), builds
the key (``keys``), and in one Redis round trip either finds the answer (a hit: an early answer under a
fresh ``id`` and ``created``, every other field as stored; for a streaming request the core replays the
stream events the answer first came as, or synthesizes them from the object), takes the single-flight
lock (this request will compute the answer), or finds another request computing it and waits for that
(``flight``). On the way back (``on_response``, which for a stream the core calls once with the
assembled answer, and only for complete streams) it stores complete answers in the background, so a
store never delays a reply (a stream's events too, recorded in ``on_chunk`` or by the core). A stream
parsed chunk by chunk is stored as the answer its events add up to as they reached ``on_chunk``, after
the chunk hooks of the plugins listed after the cache, not as the worker's assembled answer. A stream
the core recorded is stored as the worker's events, not parsed (``replay.marked_events``); a hit that
needs the answer as an object assembles it from them, and the first one that is not streamed writes it
into the entry. The writes after a reply run in the background (``writes``). Because the cache runs
before output-validating plugins and ``on_response`` runs in reverse order, an answer that a later
plugin rejected raises before it reaches the cache and is never stored, and one that a later plugin
marked ``Cache-Control: no-store`` is not stored either. The core refuses a config that lists a plugin
that replaces answers (``Plugin.replaces_answers``: guided_json's retry) before the cache.

A request whose ``max_tokens`` the gateway set (``ctx.clamped_max_tokens``: tenancy's clamp, which follows
the tenant's budget) is keyed as the client sent it, without it; only an answer the clamp did not cut (no
``finish_reason: "length"``) is stored for it, and a hit is served to it only when the stored answer's
completion fits its clamp (else it is a miss).

Redis trouble never fails a request: every call is bounded (``store``), failures open a circuit
breaker shared across reloads, and the request goes to the engine with ``x-cache: bypass``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import orjson
from redis.exceptions import RedisError

from gateway.pipeline.config import AdapterModel, GatewayConfig, ModelConfig
from gateway.pipeline.context import ModelResponse, RequestContext
from gateway.pipeline.plugin import Plugin
from gateway.pipeline.recordings import Reservation
from gateway.pipeline.services import Services
from gateway.wire.completion_bound import holds_its_count
from gateway.wire.errors import GatewayTimeout, InvalidRequest, ServiceUnavailable
from gateway.wire.streaming import StreamAssembler
from plugins.cache.config import CacheConfig
from plugins.cache.flight import wait_for_leader
from plugins.cache.keys import CacheKey, backing_of, entry_pattern, make_key
from plugins.cache.policy import (
    COMPLETE_FINISH,
    UNCUT_FINISH,
    Decision,
    decide,
    events_complete,
    is_complete,
    parse_cache_control,
    stream_choices,
)
from plugins.cache.replay import (
    body_of_events,
    fresh_answer,
    fresh_answer_of_events,
    marked_events,
    recorded_event,
    stored_body,
)
from plugins.cache.shared import SHARED_KEY, shared_state
from plugins.cache.store import (
    CacheStore,
    Lookup,
    RedisUnavailable,
    decode_entry,
    encode_entry,
    encode_events_entry,
)
from plugins.cache.writes import CacheWrites

log = logging.getLogger("plugins.cache")
_PURGE_BUDGET_S = 120.0
#: The SSE bytes of a stream the core may keep for the cache, in entries' ``max_value_bytes``: the
#: worker's events carry their id, model and framing, which a stored entry does not, so a stream whose
#: events fit an entry fits this.
_RECORD_BUDGET = 2


@dataclass(slots=True)
class _Pending:
    """What a cacheable miss carries from ``on_request`` to ``on_response`` and its finalizer."""

    key: CacheKey
    model: str  # the model the key names: an answer another model produced (a fallback) is not stored
    lock_token: bytes | None = None
    strip_usage: bool = False
    done: bool = False  # the lock was handed to a store or released
    # A streamed answer's events as they came (serialized at once: later hooks may change the dicts),
    # kept so a streaming hit replays the same chunking; None once they outgrow ``max_value_bytes`` or
    # the room the process's recordings share (``room``, taken only when the stream is parsed here).
    chunks: list[bytes] | None = None
    chunk_bytes: int = 0
    room: Reservation | None = None
    # A stream parsed chunk by chunk: the answer its events add up to as they reached the cache, which is
    # what went out after the chunk hooks of the plugins listed after it (safety's output rules redact or
    # cut a stream there), where the core's assembly is the worker's answer.
    sent: StreamAssembler | None = None


class CachePlugin(Plugin):
    name = "cache"
    Config = CacheConfig
    default_on_error = "fail_open"
    default_timeout_ms = None  # every Redis call and every wait is bounded inside the plugin
    #: A plugin that replaces answers must come after it, one that identifies callers before it (``Plugin``).
    keeps_answers = True

    def __init__(self, config: CacheConfig, services: Services) -> None:
        super().__init__(config, services)
        self._shared = shared_state(services, config)
        self.metrics = self._shared.metrics
        timeout_s = config.timeout_ms / 1000
        self.store = CacheStore(
            services.redis(socket_timeout_s=timeout_s, connect_timeout_s=timeout_s),
            services.redis_pipeline(socket_timeout_s=timeout_s, connect_timeout_s=timeout_s),
            services.redis(socket_timeout_s=5.0, connect_timeout_s=1.0),
            self._shared.breaker,
            timeout_s,
            on_error=self._redis_failed,
        )
        self.writes = CacheWrites(config, self.store, self._shared)
        self._backing: dict[str, str] = {}  # model name -> backing_of(...) in this config
        self._named: dict[str, str] = {}  # model name or alias -> the model name entries are kept under

    def prepare(self, config: GatewayConfig) -> None:
        self._named = {alias: m.name for m in config.served_models for alias in (m.name, *m.aliases)}
        managed = {w.name: w.model for w in config.engine.workers}
        # An adapter's answers come from its weights too: its path is part of what backs it.
        self._backing = {
            m.name: backing_of(m.upstream_name, [*m.workers, *_adapter_refs(m)], managed) for m in config.served_models
        }

    async def start(self) -> None:
        try:
            await self.store.warm_up()
        except RedisUnavailable as exc:  # the cache fails open; a config never depends on Redis being up
            log.warning("cache: Redis is not reachable at start-up (%s); requests bypass the cache until it is", exc)

    # -- the way in -------------------------------------------------------------------------------

    async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
        cfg = self.config
        model = ctx.model.name
        decision = decide(cfg, ctx.endpoint, model, ctx.body, ctx.headers)
        if decision.bypass:
            return self._bypass(ctx, model, decision.reason)
        if not self.store.available:
            return self._bypass(ctx, model, "redis")
        started = time.perf_counter()
        key = make_key(
            prefix=cfg.key_prefix,
            namespace=cfg.namespace,
            tenant=ctx.tenant,
            default_scope=cfg.default_scope,
            endpoint=ctx.endpoint,
            model=model,
            body=ctx.body,
            backing=self._backing.get(model, ""),
            # a max_tokens the gateway set (tenancy's clamp) follows the tenant's budget, not the request
            omit="max_tokens" if ctx.clamped_max_tokens is not None else None,
        )
        pending = _Pending(key, model)
        if decision.lookup:
            found = await self._find(ctx, pending, decision.store)
            if found is None:
                return self._bypass(ctx, model, "redis")
            if found.status == "hit" and found.entry is not None:
                answer = self._answer(ctx, pending, found.entry, decision, started)
                if answer is not None:
                    return answer
            ctx.response_headers["x-cache"] = "miss"
            self.metrics.misses.labels(model).inc()
        else:
            # no-cache: not looked up; the fresh answer is stored unless no-store came with it
            self._bypass(ctx, model, "cache_control", store=decision.store)
        if decision.store:
            ctx.state[SHARED_KEY] = pending
            if ctx.stream:
                # A stored answer carries its usage even when this client did not ask for it.
                pending.strip_usage = not ctx.ask_for_usage()
                pending.chunks = []
                pending.room = self.services.recordings.reserve(cfg.max_value_bytes)
                # A byte pass-through then, unless another plugin reads the chunks: on_response gets the
                # recorded events instead of on_chunk calls.
                ctx.record_stream(self, _RECORD_BUDGET * cfg.max_value_bytes)
        else:
            ctx.step_aside(self)
        return None

    async def _find(self, ctx: RequestContext, pending: _Pending, store: bool) -> Lookup | None:
        """The entry for ``pending.key``. Coalescing a miss that will be stored, this request leads (it
        holds the lock until its answer is stored or it ends) or waits for the leader's answer. None when
        Redis failed: the request bypasses the cache."""
        cfg, key = self.config, pending.key
        token = self._shared.lock_token() if cfg.coalesce and store else None
        try:
            found = await self._lookup(key, token)
        except (RedisUnavailable, asyncio.CancelledError) as exc:
            if token is not None:
                # A timed-out lookup, or one whose request was cancelled (the client went away), may
                # still have taken the lock in Redis (the script ran, the reply came late or was not
                # awaited): drop it, or identical requests would wait for a leader that does not know
                # it leads.
                self.writes.release_soon(key, token, local_leader=False)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return None
        if self._shared.reported_open:
            self._shared.reported_open = False
            self.metrics.breaker_open.set(0)
        if found.status == "leader":
            pending.lock_token = token
            self._shared.leaders.lead(key.digest)
            ctx.add_finalizer(lambda: self._finalize(pending))
        elif found.status == "locked":
            outcome, entry = await wait_for_leader(
                self.store,
                self._shared.leaders,
                key,
                wait_s=cfg.coalesce_wait_s,
                poll_interval_s=cfg.poll_interval_ms / 1000,
            )
            self.metrics.coalesced.labels(pending.model, outcome).inc()
            if outcome == "redis_error":
                return None
            found = Lookup("hit", entry) if entry is not None else found
        return found

    async def _lookup(self, key: CacheKey, token: bytes | None) -> Lookup:
        if self.config.coalesce:
            return await self.store.lookup(key, lock_token=token, lock_ttl_ms=int(self.config.lock_ttl_s * 1000))
        entry = await self.store.get(key)
        return Lookup("hit", entry) if entry is not None else Lookup("miss")

    def _answer(
        self, ctx: RequestContext, pending: _Pending, raw: bytes, decision: Decision, started: float
    ) -> ModelResponse | None:
        decoded = decode_entry(raw)
        if decoded is None:
            return None
        now = time.time()
        age = max(0.0, now - decoded.created)
        if decision.max_age_s is not None and age > decision.max_age_s:
            return None
        served = decoded.body or decoded.chunks  # an entry of events only has no body
        try:
            if decoded.body:
                answer = fresh_answer(decoded.body, decoded.chunks if ctx.stream else b"", int(now))
            elif ctx.stream:
                answer = fresh_answer_of_events(decoded.id_prefix, decoded.chunks, int(now))
            else:
                body = body_of_events(decoded.id_prefix, decoded.chunks)
                answer = fresh_answer(body, b"", int(now))
                self.writes.keep_body(pending.key, raw, body, decoded.created, decoded.chunks)
            clamp = ctx.clamped_max_tokens
            if clamp is not None and not _within(answer.usage, clamp):
                return None  # longer than this request may get: the worker answers it, under its clamp
        except (orjson.JSONDecodeError, TypeError, ValueError):
            return None  # an entry this version cannot read is a miss
        model = pending.model
        ctx.response_headers["x-cache"] = "hit"
        ctx.response_headers["age"] = str(int(age))
        ctx.log["cache"] = "hit"
        self.metrics.hits.labels(model).inc()
        self.metrics.bytes.labels("served").inc(len(served))
        self.metrics.hit_latency.labels(model).observe(time.perf_counter() - started)
        return answer

    def _bypass(self, ctx: RequestContext, model: str, reason: str, *, store: bool = False) -> ModelResponse | None:
        """Not answered from the cache. Unless the fresh answer is still to be stored, the cache has
        nothing more to do for this request: it steps aside, so a stream passes through as bytes."""
        ctx.response_headers["x-cache"] = "bypass"
        self.metrics.bypasses.labels(model, reason).inc()
        if not store:
            ctx.step_aside(self)
        return None

    # -- the way back -----------------------------------------------------------------------------

    async def on_chunk(self, ctx: RequestContext, chunk: dict[str, Any]) -> dict[str, Any] | None:
        pending: _Pending | None = ctx.state.get(SHARED_KEY)
        if pending is None:
            return chunk
        self._record(pending, chunk)
        if pending.strip_usage and not chunk.get("choices") and chunk.get("usage"):
            return None
        return chunk

    def _record(self, pending: _Pending, chunk: dict[str, Any]) -> None:
        if pending.sent is None:
            pending.sent = StreamAssembler()
        pending.sent.add(chunk)
        if pending.chunks is not None:
            event = recorded_event(chunk)
            pending.chunk_bytes += len(event) + 1
            room = pending.room
            if room is not None and room.fits(pending.chunk_bytes):
                pending.chunks.append(event)
            else:  # too long to keep as events (or no room left): a hit replays it synthesized
                pending.chunks = None
                if room is not None:
                    room.release()

    def _record_all(self, pending: _Pending, recorded: list[dict[str, Any]] | None) -> None:
        """A pass-through stream's events, recorded by the core, kept at once (``_record`` per event on
        the parsed path): None when they were not recorded or outgrow ``max_value_bytes`` together."""
        if recorded is None or pending.chunks is None:
            pending.chunks = None  # too long to keep as events (or not recorded: not complete below)
            return
        events = [recorded_event(chunk) for chunk in recorded]
        pending.chunk_bytes = sum(map(len, events)) + len(events)
        if pending.chunk_bytes > self.config.max_value_bytes:
            pending.chunks = None
        else:
            pending.chunks += events

    async def on_response(self, ctx: RequestContext, response: ModelResponse) -> ModelResponse | None:
        pending: _Pending | None = ctx.state.get(SHARED_KEY)
        if pending is None or pending.done or response.status != 200:
            return None
        model = ctx.model.name
        if ctx.resumed:
            # Continued on another worker after its first one failed: the text is the answer the client
            # got, but not one engine's answer to the prompt (a sampled continuation, a re-tokenized prefix).
            self.metrics.not_stored.labels(model, "resumed").inc()
            return None
        if model != pending.model:  # served by a fallback or canary: not the answer the key names
            self.metrics.not_stored.labels(pending.model, "rerouted").inc()
            return None
        control = response.headers.get("cache-control")
        if control and parse_cache_control(control)[1]:
            # A later plugin's word that this is not the answer to give others (guided_json: a stream cut
            # where the same request not streamed is retried), as an HTTP cache honours a response's no-store.
            self.metrics.not_stored.labels(model, "no_store").inc()
            return None
        # Under a clamp the key is the request without max_tokens: only an answer the clamp did not cut
        # is the answer to that request.
        finished = COMPLETE_FINISH if ctx.clamped_max_tokens is None else UNCUT_FINISH
        if ctx.stream and not pending.chunk_bytes:  # passed through as bytes: recorded by the core
            if self._store_events(ctx, pending, model, response.recorded_events, finished):
                return None
            self._record_all(pending, response.recorded)
        try:
            # Parsed chunk by chunk, the answer is what went out, not the worker's: a whole request must
            # not be served text a chunk hook redacted or cut from the stream.
            answer = pending.sent.result() if pending.sent is not None else response.json
            complete = is_complete(answer, finished)
        except orjson.JSONDecodeError:
            answer, complete = {}, False
        if not complete:
            cut = finished is UNCUT_FINISH and is_complete(answer)
            self.metrics.not_stored.labels(model, "clamped" if cut else "incomplete").inc()
            return None
        if not holds_its_count(answer):
            # A faulty or hostile worker's usage (10^9 tokens in a line of text): every hit would replay it,
            # and billing reads a replayed stream's usage alone. (A stream the core recorded is not handed
            # over with such a usage.)
            self.metrics.not_stored.labels(model, "bad_usage").inc()
            return None
        body = stored_body(answer)
        if len(body) > self.config.max_value_bytes:
            self.metrics.not_stored.labels(model, "too_large").inc()
            return None
        chunks = b""
        if pending.chunks and len(body) + pending.chunk_bytes <= self.config.max_value_bytes:
            chunks = b"\n".join(pending.chunks)
        pending.chunks = None
        if pending.room is not None:
            pending.room.release()  # the entry goes to the write queue, bounded on its own (``writes.full``)
        self._store_entry(pending, model, encode_entry(body, time.time(), chunks))
        return None

    def _store_events(
        self, ctx: RequestContext, pending: _Pending, model: str, events: bytes | None, finished: frozenset[str]
    ) -> bool:
        """A recorded stream stored as its events only, without parsing them (``marked_events``); False
        when they must be assembled instead (not recorded, not in the form every worker event takes, or
        longer than an entry: then the answer alone is stored). ``finished``: the finish reasons of an
        answer that may be stored (``is_complete``)."""
        choices = stream_choices(ctx.endpoint, ctx.body)
        if events is None or choices is None or pending.chunks is None or len(events) > self.config.max_value_bytes:
            return False
        complete = events_complete(events, choices, finished)
        if complete is None:
            return False
        if not complete:
            cut = finished is UNCUT_FINISH and events_complete(events, choices)
            self.metrics.not_stored.labels(model, "clamped" if cut else "incomplete").inc()
            return True
        marked = marked_events(events)
        if marked is None:
            return False
        chunks, id_prefix = marked
        pending.chunks = None
        self._store_entry(pending, model, encode_events_entry(id_prefix, time.time(), chunks))
        return True

    def _store_entry(self, pending: _Pending, model: str, entry: bytes) -> None:
        if self.writes.full:
            self.metrics.not_stored.labels(model, "backlog").inc()
            return
        pending.done = True
        self.writes.store_answer(pending.key, pending.lock_token, model, entry)

    def _finalize(self, pending: _Pending) -> None:
        """The request is over without storing (error, cut stream, refusal, not storable, client
        gone): release the lock now so waiting requests go to the engine instead of waiting it out."""
        if pending.done or pending.lock_token is None:
            return
        pending.done = True
        self.writes.release_soon(pending.key, pending.lock_token)

    def _redis_failed(self, op: str) -> None:
        self.metrics.errors.labels(op).inc()
        if self.store.breaker.state == "open" and not self._shared.reported_open:
            self._shared.reported_open = True
            self.metrics.breaker_open.set(1)

    # -- admin and lifecycle ----------------------------------------------------------------------

    async def on_admin(self, action: str, body: dict[str, Any]) -> dict[str, Any]:
        """``purge``: delete the entries of a namespace (default: the live one), or of one model in it (by
        its name or an alias; a name this config does not know, a model removed from it, as given)."""
        if action != "purge":
            return await super().on_admin(action, body)
        namespace = body.get("namespace", self.config.namespace)
        model = body.get("model")
        if not isinstance(namespace, str) or not namespace or ":" in namespace:
            raise InvalidRequest("'namespace' must be a non-empty string without ':'.", param="namespace")
        if model is not None and (not isinstance(model, str) or not model):
            raise InvalidRequest("'model' must be a non-empty string.", param="model")
        if model is not None:  # entries are kept under the model's name, whatever name a client used
            model = self._named.get(model, model)
        pattern = entry_pattern(self.config.key_prefix, namespace, model)
        try:
            async with asyncio.timeout(_PURGE_BUDGET_S):
                deleted = await self.store.purge(pattern)
        except TimeoutError:
            raise GatewayTimeout(
                f"Purging the cache took longer than {_PURGE_BUDGET_S:.0f} s; run it again to finish.",
                code="cache_purge_timeout",
            ) from None
        except (RedisError, OSError) as exc:
            raise ServiceUnavailable(
                f"Redis is unavailable, so the cache was not purged ({type(exc).__name__}); try again later.",
                code="cache_unavailable",
            ) from None
        return {"purged": deleted, "namespace": namespace, "model": model}

    async def aclose(self) -> None:
        await self.writes.drain()


def _within(usage: Any, clamp: int) -> bool:
    """Whether an answer of ``usage`` gives no choice more completion tokens than ``clamp``: its whole
    completion fits in one choice's clamp (an answer of several choices may miss that could have fit;
    the usage does not say how its tokens are shared). An answer without a readable usage does not."""
    completion = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return type(completion) is int and 0 <= completion <= clamp


def _adapter_refs(model: ModelConfig) -> list[str]:
    return [f"lora={model.adapter.path}"] if isinstance(model, AdapterModel) else []
