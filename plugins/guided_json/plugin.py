"""The guided_json plugin: a client that asks for JSON matching a schema gets it, or a clear error.

``on_request``: normalise whatever form the client used (``forms``), compile it at the gateway under
budgets (``compile``; a refusal is a 400 before any upstream call), make sure the model's workers
enforce constraints (``probe``), then rewrite the body into the one form vLLM 0.32 enforces.
``on_response``: check every answer (``validate``): a cut answer goes back as it is (finish_reason
``length``; retried once first only when the client set no token limit and it was not streamed; a
stream that would have been is marked ``Cache-Control: no-store``), an invalid complete one is refused
with a 422. A forced tool call's ``parameters`` schema (``tool_choice`` naming a function: the worker decodes
the call under it; ``"required"``: every tool's) is compiled under the same budgets (the body keeps the
tools), and each call of a chat answer is checked against its function's (``tool_calls``). A request
with neither steps aside: no hook of this plugin runs on its way back.

The cache plugin runs before this one (a config that lists this one first is refused:
``replaces_answers``), so its key is computed from the client's own fields and it only stores answers
this plugin let through, as this plugin left them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import orjson
from prometheus_client import Counter

from gateway.pipeline.context import ModelResponse, RequestContext
from gateway.pipeline.plugin import Plugin
from gateway.pipeline.services import Services
from gateway.upstream.client import UpstreamFailure
from gateway.wire.errors import GatewayError, ServiceUnavailable, from_upstream
from plugins.guided_json.compile import Checker, CompileCache, Compiled
from plugins.guided_json.config import GuidedJSONConfig
from plugins.guided_json.forms import Constraint, ForcedTool, forced_tools, normalise, rewrite
from plugins.guided_json.probe import CapabilityTable
from plugins.guided_json.tool_calls import ForcedCalls, find_call_problems
from plugins.guided_json.validate import Problem, error_for, find_problems, retry_budget, with_budget

log = logging.getLogger("plugins.guided_json")
_GUIDED_ENDPOINTS = frozenset({"chat/completions", "completions"})
#: The finish_reason label's values: OpenAI's and vLLM's. A worker may answer anything there (a hostile or
#: broken one, a new reason each time), and every label value is a series kept for the process's life.
_FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call", "abort"})


def _finish_label(reason: object) -> str:
    """``reason`` as a label value: one of ``_FINISH_REASONS``, "none" when missing, else "other"."""
    if not reason:
        return "none"
    return reason if isinstance(reason, str) and reason in _FINISH_REASONS else "other"


@dataclass(frozen=True, slots=True)
class Checks:
    """What a request's answer is checked against: its output constraint, its forced tool calls (chat
    only: a legacy completion has no tool calls), or both."""

    compiled: Compiled | None
    calls: ForcedCalls | None


@dataclass
class GuidedShared:
    """What outlives a config reload: compiled constraints, worker capabilities, metrics."""

    compiles: CompileCache
    capabilities: CapabilityTable
    compile_outcomes: Counter
    invalid_answers: Counter

    @classmethod
    def create(cls, services: Services) -> GuidedShared:
        registry = services.metrics.registry
        return cls(
            compiles=CompileCache(),
            capabilities=CapabilityTable(),
            compile_outcomes=Counter(
                "gateway_guided_json_constraints",
                "Output constraints seen, by outcome (cached|compiled|refused)",
                ["outcome"],
                registry=registry,
            ),
            invalid_answers=Counter(
                "gateway_guided_json_invalid_answers",
                "Answers that did not satisfy their constraint, by model, finish_reason and what followed"
                " (refused|retried|retry_ok|returned; forced tool calls: tool_refused|tool_returned)",
                ["model", "finish_reason", "action"],
                registry=registry,
            ),
        )


class GuidedJSONPlugin(Plugin):
    name = "guided_json"
    Config = GuidedJSONConfig
    # on_response may retry a cut answer or mark a stream no-store: a plugin that keeps answers (the
    # cache) must see the answer after that, so a config listing this plugin before it is refused.
    replaces_answers = True

    def __init__(self, config: GuidedJSONConfig, services: Services) -> None:
        super().__init__(config, services)
        shared = services.shared.get(self.name)
        if not isinstance(shared, GuidedShared):
            shared = services.shared[self.name] = GuidedShared.create(services)
        shared.compiles.configure(config)
        self.shared = shared

    async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
        guided = ctx.endpoint in _GUIDED_ENDPOINTS
        forced = forced_tools(ctx.body) if guided else None
        calls = None if forced is None else await self._compile_tools(forced, ctx.tenant)
        if ctx.endpoint != "chat/completions":
            calls = None
        constraint = normalise(ctx.body) if guided else None
        if constraint is None and calls is None:
            ctx.step_aside(self)  # nothing to check on the way back
            return None
        compiled = None
        if constraint is not None:
            compiled = await self._compile(constraint, ctx.tenant)
            if self.config.probe:
                await self._require_capable_workers(ctx)
            rewrite(ctx.body, compiled.upstream)
            ctx.mark_body_changed()
        ctx.state[self.name] = Checks(compiled, calls)
        return None

    async def _compile_tools(self, forced: list[ForcedTool], tenant: str | None) -> ForcedCalls:
        """Each forced function's schema compiled (the worker decodes calls under it: response_format's
        budgets, and its refusals), as the checks of the calls that come back."""
        allowed: dict[str, tuple[Checker | None, ...]] = {}
        for tool in forced:
            check = None if tool.constraint is None else (await self._compile(tool.constraint, tenant)).check
            allowed[tool.name] = (*allowed.get(tool.name, ()), check)
        return ForcedCalls(allowed)

    async def _compile(self, constraint: Constraint, tenant: str | None) -> Compiled:
        """The compiled constraint (from the cache, or compiled under the budgets and ``tenant``'s limit
        of compiles in flight); a refusal is raised."""
        try:
            compiled, cached = await self.shared.compiles.get(constraint, tenant)
        except GatewayError as error:
            self.shared.compile_outcomes.labels("refused").inc()
            raise error
        self.shared.compile_outcomes.labels("cached" if cached else "compiled").inc()
        return compiled

    async def _require_capable_workers(self, ctx: RequestContext) -> None:
        """Probe the model's workers once; refuse rather than send a constraint a worker would ignore."""
        urls = [u for u in ctx.snapshot.models.worker_urls.get(ctx.model.name, []) if u.startswith("http")]
        if not urls:
            return
        known = await self.shared.capabilities.check(
            self.services.upstream,
            urls,
            endpoint=ctx.endpoint,
            served_model=ctx.model.upstream_name,
            timeout_s=self.config.probe_timeout_s,
            recheck_s=self.config.probe_recheck_s,
        )
        bad = {url: cap.detail for url, cap in known.items() if not cap.honours}
        if bad:
            url, why = next(iter(bad.items()))
            raise ServiceUnavailable(
                f"Model '{ctx.model.name}' has a worker that does not enforce output constraints ({url}: {why});"
                " guided requests are refused rather than answered unconstrained.",
                code="guided_decoding_unsupported",
                headers={"x-should-retry": "false"},  # the SDK's retries within seconds cannot change that
            )

    async def on_response(self, ctx: RequestContext, response: ModelResponse) -> ModelResponse | None:
        checks: Checks | None = ctx.state.get(self.name)
        if checks is None or response.status != 200:
            return None
        if checks.calls is not None:
            self._check_calls(ctx, checks.calls, response)
        if checks.compiled is None:
            return None
        return await self._check_output(ctx, checks.compiled, response)

    def _check_calls(self, ctx: RequestContext, calls: ForcedCalls, response: ModelResponse) -> None:
        """Refuse an answer whose forced tool calls fail (a cut one is returned as it is, not retried)."""
        problems = find_call_problems(calls, response.json)
        if not problems:
            return
        broken = self._first_broken(problems)
        invalid = self.shared.invalid_answers.labels
        if broken is not None:
            invalid(ctx.model.name, _finish_label(broken.finish_reason), "tool_refused").inc()
            raise error_for(broken, "tools")
        invalid(ctx.model.name, "length", "tool_returned").inc()

    @staticmethod
    def _first_broken(problems: list[Problem]) -> Problem | None:
        return next((p for p in problems if not p.truncated), None)

    async def _check_output(
        self, ctx: RequestContext, compiled: Compiled, response: ModelResponse
    ) -> ModelResponse | None:
        """The answer's text against the output constraint: a 422, the answer cut and returned, or retried."""
        problems = find_problems(compiled, response.json)
        if not problems:
            return None
        invalid = self.shared.invalid_answers
        model = ctx.model.name
        broken = self._first_broken(problems)
        if broken is not None:
            invalid.labels(model, _finish_label(broken.finish_reason), "refused").inc()
            raise error_for(broken, compiled.kind)
        # Only cut answers: returned as OpenAI returns them (finish_reason "length", the partial text),
        # after one retry when the client set no limit and the context has room for more.
        budget = None
        if self.config.on_invalid == "retry" and ctx.worker is not None:
            budget = retry_budget(
                ctx.body,
                response.json.get("usage"),
                max_model_len=ctx.model.max_model_len,
                cap=self.config.retry_max_tokens,
            )
        if budget is not None and ctx.stream:
            # A stream's text has gone out: it is not retried, where the same request not streamed would
            # be. So this cut answer is not the request's answer in either shape, and a cache that keeps one
            # answer for both (the response cache) must not serve it in place of the retried one.
            response.headers["cache-control"] = "no-store"
            budget = None
        if budget is None:
            invalid.labels(model, "length", "returned").inc()
            return None
        invalid.labels(model, "length", "retried").inc()
        retried = await self._retry(ctx, budget)
        again = find_problems(compiled, retried.json)
        broken = self._first_broken(again)
        if broken is not None:
            invalid.labels(model, _finish_label(broken.finish_reason), "refused").inc()
            raise error_for(broken, compiled.kind)
        invalid.labels(model, "length", "returned" if again else "retry_ok").inc()
        return retried

    async def _retry(self, ctx: RequestContext, budget: int) -> ModelResponse:
        """The same request once more, to the same worker, with ``max_tokens=budget``."""
        assert ctx.worker is not None
        log.info("request %s: guided answer cut by max_tokens; retrying with %d", ctx.request_id, budget)
        body = orjson.dumps(with_budget(ctx.body, budget))
        try:
            upstream = await self.services.upstream.open(ctx.worker.url, ctx.path, body)
            raw = await upstream.read()
        except UpstreamFailure as failure:
            raise failure.error from None
        if upstream.status != 200:
            raise from_upstream(upstream.status, raw)
        return ModelResponse(body=raw)

    async def aclose(self) -> None:
        # The compile cache and its thread are process-wide (services.shared): a reload keeps them.
        return None
