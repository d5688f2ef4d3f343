"""TenancyPlugin: who is calling (API key -> tenant), may they use this model, and are they within
their rate limits and budgets. Runs first in the plugin order, so a refused request costs nothing
downstream and the cache can namespace by ``ctx.tenant``.

Per request: one HMAC of the key, a key lookup (config, or Redis behind a sub-second local cache),
one Redis script that reserves the request's worst case in every limit and budget on the way in, and
one that settles the charge to what was delivered. Refusals: 401 ``invalid_api_key``, 404
``model_not_found`` (what OpenAI answers for a model the key may not use, so a key cannot probe which
models exist), 429 with ``Retry-After`` and OpenAI's ``x-ratelimit-*`` headers, 503 when Redis is
unreachable and the deployment chose ``redis_down: fail_closed``.

What is reserved: the prompt estimate plus ``max_tokens`` x ``n``; without ``max_tokens``, what the
request can cost ((context - prompt) x ``n``), or, with ``without_max_tokens: clamp``, as much as the
key and tenant have left (and the request's ``max_tokens`` is set to it, and recorded as
``ctx.clamped_max_tokens``: the cache keys the request as the client sent it). What is charged: an
answer's usage; a stream's usage when it carried one to its end, else the prompt estimate and the
tokens it sent, however it ended (``ctx.delivered``, kept by the core); the prompt estimate for a
client that hung up after its request reached a worker, before anything came back; nothing for a
refusal or a failure. Answers and completed streams are charged as they go out (``on_response``: the
charge is queued in Redis's batch before the answer is sent, ahead of every command this gateway sends for
a later request, and the answer does not wait for Redis's reply); the rest when the request is over (a
finalizer). The key's allow-list goes with the request (``ctx.model_allowed``: routing checks canaries
and fallbacks), and the tenant's configured priority
(``ctx.priority``) orders the routing queue. With ``prefix_cache: tenant`` (the default) every request
carries a ``cache_salt`` bound to its tenant, so a worker's prefix cache is shared within a tenant only
(``plugins.tenancy.prefix_salt``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, ClassVar

from gateway.pipeline.batch_config import CALLER_OF, BatchLine, Caller
from gateway.pipeline.config import GatewayConfig
from gateway.pipeline.context import ModelResponse, RequestContext
from gateway.pipeline.plugin import Plugin, SideCall
from gateway.pipeline.services import TENANT_OF, Services
from gateway.wire.chat_answer import count
from gateway.wire.errors import GatewayError, model_not_found
from gateway.wire.protocol import requested_choices, requested_prompts
from plugins.tenancy import estimate
from plugins.tenancy.admin import TenancyAdmin
from plugins.tenancy.admitted import Admitted
from plugins.tenancy.batch_lines import LINE_PRIORITY, batch_line, caller, line_key, priced, priced_pair
from plugins.tenancy.charges import Charges
from plugins.tenancy.config import NO_LIMITS, TenancyConfig, TenantConfig
from plugins.tenancy.keys import KeyInfo, KeyStore
from plugins.tenancy.limits import REDIS_ERRORS, Decision, LocalLimiter, Plan, RedisLimiter
from plugins.tenancy.metrics import TenancyMetrics
from plugins.tenancy.plans import Plans
from plugins.tenancy.prefix_salt import TenantSalts
from plugins.tenancy.refusals import invalid_key, missing_key, refusal, unavailable

log = logging.getLogger("gateway.tenancy")
CLAMP_HEADER = "x-gateway-max-tokens"
#: The most tokens a request reserves: the admission script's numbers are doubles, exact to 2^53, and
#: Redis counts in 64-bit integers (a larger max_tokens, which vLLM clamps to the context, failed the
#: script as if Redis were down).
MAX_RESERVATION = 2**53


#: Endpoints whose answer is generated tokens (the rest, embeddings and the pooling routes, cost their prompt).
_GENERATING = frozenset({"chat/completions", "completions"})
#: Endpoints that reserve a completion: the generating ones and vLLM's speech-to-text routes, which generate
#: tokens too (their form has no max_tokens the gateway could clamp, so only _GENERATING clamps).
_RESERVING = _GENERATING | {"audio/transcriptions", "audio/translations"}


class TenancyPlugin(Plugin):
    name = "tenancy"
    Config = TenancyConfig
    default_on_error = "fail_closed"
    #: It decides who is calling: a plugin that keeps answers (the cache) must come after it.
    identifies_callers = True
    #: Billing needs a stream's usage, not its text: streams keep the byte pass-through.
    reads_stream_text = False
    #: Wall clock (epoch seconds) that decides budget periods; a test subclass may replace it.
    clock: ClassVar[Callable[[], float]] = staticmethod(time.time)

    config: TenancyConfig

    def __init__(self, config: TenancyConfig, services: Services) -> None:
        super().__init__(config, services)
        timeout_s = config.redis_timeout_ms / 1000
        self.redis = services.redis(socket_timeout_s=timeout_s, connect_timeout_s=timeout_s)
        self._pepper_set = bool(os.environ.get(config.pepper_env))
        pepper = os.environ.get(config.pepper_env, "").encode()
        self.metrics = TenancyMetrics.of(services)
        self.keys = KeyStore(
            self.redis,
            config.redis_prefix,
            pepper,
            config.keys,
            ttl_s=config.key_cache_ttl_s,
            max_entries=config.key_cache_size,
            on_gone=self.metrics.forget_key,
        )
        self.limiter = RedisLimiter(
            self.redis, services.redis_pipeline(socket_timeout_s=timeout_s, connect_timeout_s=timeout_s)
        )
        self.local = LocalLimiter(config.fail_open_share)
        self.admin = TenancyAdmin(config, self.redis, self.keys, type(self).clock)
        self.charges = Charges(self.limiter, self.local, self.metrics, self._redis_failed)
        self._own_context: dict[str, int] = {}  # model name -> its own context tokens
        self._context: dict[str, int] = {}  # model name -> the longest context a request for it may reach
        self._names: dict[str, tuple[str, ...]] = {}  # model name -> it and its aliases
        self.plans = Plans(config, lambda: type(self).clock())
        self._salts = TenantSalts() if config.prefix_cache == "tenant" else None

    def prepare(self, config: GatewayConfig) -> None:
        """Learn each model's context: its max_model_len, else its managed workers', else the default."""
        self._names = {model.name: (model.name, *model.aliases) for model in config.served_models}
        managed = {w.name: w.max_model_len for w in config.engine.workers}
        for model in config.served_models:
            lengths = [managed[ref] for ref in model.workers if managed.get(ref)]
            context = model.max_model_len or (min(lengths) if lengths else None)  # type: ignore[type-var]
            self._own_context[model.name] = int(context or self.config.default_context_tokens)

    def _context_of(self, ctx: RequestContext) -> int:
        """The longest context among the models a request for ``ctx.model`` may end up on (canary targets
        and fallbacks, as the snapshot's model graph says): a reservation must cover wherever it goes.
        Kept per model: this instance serves one snapshot."""
        name = ctx.model.name
        context = self._context.get(name)
        if context is None:
            own, default = self._own_context, self.config.default_context_tokens
            context = max(own.get(m, default) for m in ctx.snapshot.models.reachable(name))
            self._context[name] = context
        return context

    async def start(self) -> None:
        """Refuses a config whose keys take an id the admin API created (in use or revoked: an id names one
        key for good, ``plugins.tenancy.keys``). With Redis away that cannot be read: the config loads, and
        a created key under a declared id is refused at every lookup instead."""
        if self.config.auth and not self._pepper_set:
            log.warning("tenancy: %s is not set; key digests are unpeppered HMACs", self.config.pepper_env)
        try:
            clashing = await self.keys.claim_config_ids()
        except REDIS_ERRORS as exc:
            self._redis_failed("lookup", exc)
            return
        if clashing:
            names = ", ".join(f"'{key_id}'" for key_id in clashing)
            raise ValueError(
                f"keys: id {names} was created through the admin API (create_key), and an id names one key for "
                "good (its usage, its batches); give the config's key another id"
            )

    def went_live(self) -> None:
        """Who is calling, for the core (stored Responses, batch lines), is now this config's answer: not
        before, since a later plugin may refuse this config, whose ``aclose`` then leaves the live one's.
        The keys the previous live config declared and this one drops lose their series."""
        self.services.shared[TENANT_OF] = self.tenant_of
        self.services.shared[CALLER_OF] = self.caller_of
        self.metrics.config_live(key.id for key in self.config.keys)

    async def aclose(self) -> None:
        if self.services.shared.get(TENANT_OF) == self.tenant_of:
            del self.services.shared[TENANT_OF]
        if self.services.shared.get(CALLER_OF) == self.caller_of:
            del self.services.shared[CALLER_OF]
        await self.charges.settled()

    async def tenant_of(self, headers: dict[str, str]) -> str:
        """Who is calling, for what the gateway keeps per tenant (stored Responses): the key's tenant
        (401 without a valid key, as ``on_request``), or the anonymous tenant when auth is off."""
        if not self.config.auth:
            return self.config.anonymous_tenant
        return (await self._authenticate(headers)).tenant

    async def caller_of(self, headers: dict[str, str]) -> Caller:
        """The core's ``CALLER_OF``: the key's tenant and id (what a batch's lines run as later)."""
        info = await self._authenticate(headers) if self.config.auth else None
        return caller(info, self.config.anonymous_tenant)

    async def _line_key(self, line: BatchLine) -> KeyInfo:
        try:
            return await line_key(self.keys, line)
        except REDIS_ERRORS as exc:
            self._redis_failed("lookup", exc)
            raise unavailable() from None

    async def on_admin(self, action: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.admin.handle(action, body)

    # -- the way in -------------------------------------------------------------------------------

    async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
        info: KeyInfo | None = None
        line = batch_line(ctx)
        if self.config.auth:
            info = await (self._line_key(line) if line is not None else self._authenticate(ctx.headers))
            if not info.allows(ctx.requested_model, ctx.model.name):
                self.metrics.refusals.labels(info.tenant, "model_not_allowed").inc()
                raise model_not_found(ctx.requested_model)  # the core's answer for an unknown model
            ctx.tenant, ctx.api_key_id = info.tenant, info.id
            ctx.log["api_key_id"] = info.id
            names = self._names
            # canaries and fallbacks ask before moving the request (a model is allowed by any of its names)
            ctx.model_allowed = lambda model: info.allows(*names.get(model, (model,)))
        else:
            ctx.tenant = self.config.anonymous_tenant
        tenant = ctx.tenant
        tenant_config = self.config.tenants.get(tenant, NO_LIMITS)
        ctx.priority = LINE_PRIORITY if line is not None else self._priority(tenant_config, ctx.headers)
        factor = self.config.batch_price_factor if line is not None else 1.0
        plan = self.plans.of(info, tenant)
        prompt = estimate.prompt_tokens(ctx.endpoint, ctx.body, self.config.media_tokens)
        want, least, clamp = self._reservation(ctx, prompt)
        want, least = min(priced(want, factor), MAX_RESERVATION), min(priced(least, factor), MAX_RESERVATION)
        decision, via_redis = await self._admit(plan, want, least, tenant)
        if not decision.admitted:
            raise self._refusal(decision, decision.granted or least, tenant)
        reserved = decision.granted if via_redis or clamp else want
        if clamp:
            choices = requested_choices(ctx.body) * requested_prompts(ctx.endpoint, ctx.body)
            affordable = int(reserved / factor) if factor > 0 else want
            clamped = ctx.clamped_max_tokens = max(1, (affordable - prompt) // choices)  # per choice of each prompt
            ctx.body["max_tokens"] = clamped
            ctx.mark_body_changed()
            ctx.response_headers[CLAMP_HEADER] = str(clamped)
        ctx.response_headers.update(decision.headers())
        if self._salts is not None:
            self._salts.apply(ctx, tenant)
        admitted = ctx.state[self.name] = Admitted(plan, reserved, prompt, via_redis, factor=factor)
        ctx.add_finalizer(lambda: self._finish(ctx, admitted))
        self.metrics.admitted.labels(tenant, info.id if info else "-").inc()
        return None

    def _reservation(self, ctx: RequestContext, prompt: int) -> tuple[int, int, bool]:
        """(tokens wanted, the least acceptable, clamping?) for the admission script. Without max_tokens
        the request can cost (context - prompt) per choice; clamping reserves what is left instead."""
        if not self.config.reserve_max_tokens or ctx.endpoint not in _RESERVING:
            return prompt, prompt, False
        given = estimate.reserved_completion(ctx.endpoint, ctx.body)
        if given:
            return prompt + given, prompt + given, False
        choices = requested_choices(ctx.body)
        context = self._context_of(ctx)
        # each prompt of a batch may fill the context: (context - its own prompt) per prompt and choice
        prompts = requested_prompts(ctx.endpoint, ctx.body)
        worst = prompt + max(prompts, prompts * context - prompt) * choices
        if self.config.without_max_tokens == "clamp" and ctx.endpoint in _GENERATING:
            return worst, prompt + prompts * choices, True
        return worst, worst, False

    def _priority(self, tenant: TenantConfig, headers: dict[str, str]) -> int:
        """The tenant's configured priority; its client's header only when the tenant allows it (capped)."""
        cap = tenant.client_priority_max
        raw = headers.get(self.config.priority_header) if cap is not None else None
        if cap is None or not raw:
            return tenant.priority
        try:
            return max(-1000, min(cap, int(raw)))
        except ValueError:
            return tenant.priority

    async def on_models(self, headers: dict[str, str], models: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """With auth on, listing models needs a valid key, and lists only what that key may use."""
        if not self.config.auth:
            return models
        info = await self._authenticate(headers)
        return [card for card in models if info.allows(card["id"], card.get("root", card["id"]))]

    async def on_side_request(self, call: SideCall) -> None:
        """A request to a route without inference (models, tokenize, detokenize, stored Responses, the
        Files and Batch APIs) counts against the key's and the tenant's request limits like any other (a
        429 past them); it is charged no tokens and touches no token bucket or budget. ``responses.create``
        (a Responses turn about to load the conversation it continues) is checked, by the least the turn
        can cost, not counted: its
        ``on_request`` counts it."""
        info = await self._authenticate(call.headers) if self.config.auth else None
        tenant = info.tenant if info is not None else self.config.anonymous_tenant
        plan = self.plans.of(info, tenant)
        if call.route == "responses.create":
            await self._check(plan, self._least(call.body), tenant)
            return
        requests = Plan([b for b in plan.buckets if b.kind == "requests"], [])
        if not requests.buckets:
            return
        decision, _ = await self._admit(requests, 0, 0, tenant)
        if not decision.admitted:
            raise self._refusal(decision, 0, tenant)

    def _least(self, chat: dict[str, Any]) -> int:
        """The fewest tokens ``on_request`` can reserve for a chat request that holds at least ``chat``
        (a Responses turn, before the conversation it continues is added): a longer prompt only adds,
        and the completion is at least its ``max_tokens``, else one token per choice (what clamping
        grants at least; reserving without max_tokens takes more)."""
        if not chat:
            return 1
        prompt = estimate.prompt_tokens("chat/completions", chat, self.config.media_tokens)
        if not self.config.reserve_max_tokens:
            return prompt
        completion = estimate.reserved_completion("chat/completions", chat) or requested_choices(chat)
        return min(prompt + completion, MAX_RESERVATION)

    async def _check(self, plan: Plan, least: int, tenant: str) -> None:
        """Refuse (429) a request that ``on_request`` would refuse, judged by ``least`` tokens, the fewest
        it can reserve: one past a request limit, or without that many tokens left in a token bucket or
        budget. Reserves nothing; a request that passes is admitted (or refused for its full size) by
        ``on_request``, as any other."""
        if not plan.buckets and all(budget.limit is None for budget in plan.budgets):
            return  # nothing limited: no Redis call
        try:
            decision = await self.limiter.check(plan, least)
        except REDIS_ERRORS as exc:
            self._redis_failed("check", exc)
            if self.config.redis_down == "fail_closed":
                self.metrics.refusals.labels(tenant, "redis_unavailable").inc()
                raise unavailable() from None
            return  # fail_open: on_request applies this replica's own limits
        if not decision.admitted:
            raise self._refusal(decision, least, tenant)

    async def _authenticate(self, headers: dict[str, str]) -> KeyInfo:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            self.metrics.refusals.labels("-", "missing_api_key").inc()
            raise missing_key()
        digest = self.keys.digest(token)
        try:
            info = await self.keys.lookup(digest)
        except REDIS_ERRORS as exc:
            self._redis_failed("lookup", exc)
            info = self.keys.stale(digest) if self.config.redis_down == "fail_open" else None
            if info is None:
                raise unavailable() from None
        if info is None:
            self.metrics.refusals.labels("-", "invalid_api_key").inc()
            raise invalid_key()
        return info

    async def _admit(self, plan: Plan, tokens: int, least: int, tenant: str) -> tuple[Decision, bool]:
        try:
            return await self.limiter.admit(plan, tokens, least), True
        except REDIS_ERRORS as exc:
            self._redis_failed("admit", exc)
            if self.config.redis_down == "fail_closed":
                self.metrics.refusals.labels(tenant, "redis_unavailable").inc()
                raise unavailable() from None
            return self.local.admit(plan, tokens, least), False

    def _refusal(self, decision: Decision, requested: int, tenant: str) -> GatewayError:
        reason, error = refusal(decision, requested, type(self).clock())
        self.metrics.refusals.labels(tenant, reason).inc()
        return error

    def _redis_failed(self, op: str, exc: BaseException) -> None:
        self.metrics.redis_errors.labels(op).inc()
        log.warning("tenancy: Redis %s failed (%s); policy %s", op, type(exc).__name__, self.config.redis_down)

    # -- the way back -----------------------------------------------------------------------------

    async def on_response(self, ctx: RequestContext, response: ModelResponse) -> ModelResponse | None:
        """Charges the answer (or the completed stream) as it goes out, so the client's next request sees
        the usage (``Charges.apply``); ``_finish`` corrects the charge when the request ends otherwise (a later
        hook refused the answer, the stream was cut, the client went away)."""
        admitted: Admitted | None = ctx.state.get(self.name)
        if admitted is None or response.status != 200:
            return None
        sent = ctx.delivered
        # A JSON answer is read whole (parsed already, to find its usage): its completion count is believed
        # only up to what its text can hold. A stream's ``response.usage``: a recorded or replayed stream is
        # not assembled only to find it (the core hands over no usage its events cannot hold, and the cache
        # stores none). Without a usage the answer's text gives an estimate, except for a counted stream,
        # which is then billed by the tokens it sent (``delivered``).
        usage = estimate.reported_usage({"usage": response.usage} if ctx.stream else response.json)
        if usage is None and ctx.stream and (sent is None or sent.stream_tokens is None):
            usage = estimate.reported_usage(response.json)
        if usage is not None:
            prompt = usage[0] if usage[0] is not None else admitted.prompt_estimate
            admitted.answer = (prompt, usage[1])
        if ctx.stream and (sent is None or sent.stream_tokens is None):
            return None  # a replayed (cached) answer: charged at the end, like any other
        prompt, completion = priced_pair(self.delivered(ctx, admitted, answered=True), admitted.factor)
        change = admitted.settle_to(prompt, completion)
        if change is not None:
            self.charges.apply(ctx.tenant or "-", admitted, *change)
        return None

    def _finish(self, ctx: RequestContext, admitted: Admitted) -> None:
        """The request is over (finalizer): charge what was delivered, release the rest."""
        if admitted.finished:
            return
        admitted.finished = True
        prompt, completion = priced_pair(self.delivered(ctx, admitted), admitted.factor)
        change = admitted.settle_to(prompt, completion)
        if change is not None:
            self.charges.apply(ctx.tenant or "-", admitted, *change)

    @staticmethod
    def delivered(ctx: RequestContext, admitted: Admitted, *, answered: bool = False) -> tuple[int, int]:
        """(prompt, completion) tokens the client is charged: an answer's usage; a stream's usage when it
        carried one and ended, else the prompt estimate and the tokens it sent; the prompt estimate when
        the client went away after its request reached a worker and before any token came back (the
        worker had read the prompt, and may have generated more); nothing for a refusal or a failure
        (no answer, or no stream event, reached the client, and the client did not hang up). ``answered``:
        called from ``on_response``, where the answer is about to be sent."""
        sent = ctx.delivered
        if not answered:
            if sent is None:
                if ctx.client_gone and ctx.reached_worker:  # hung up while the worker had it: not for free
                    return admitted.answer or (admitted.prompt_estimate, 0)
                return 0, 0
            if sent.status != 200:
                return 0, 0
        if sent is None or sent.stream_tokens is None:  # an answer (also a cached one replayed as a stream)
            return admitted.answer or (admitted.prompt_estimate, 0)
        usage = sent.usage
        if usage is not None and admitted.answer is not None and (sent.complete or answered):
            return admitted.answer
        if sent.stream_tokens == 0 and not (sent.complete or answered or ctx.client_gone):
            return 0, 0  # the worker cut it before any token went out: a failure, like an error before the first byte
        prompt = count(usage.get("prompt_tokens")) if isinstance(usage, dict) else None  # a worker's -1: not believed
        return (prompt if prompt is not None else admitted.prompt_estimate), sent.stream_tokens
