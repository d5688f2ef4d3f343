"""Safety: screen prompts before they reach cache or engine, and optionally check completions.

On the way in (``on_request``), in this order, all per model: shape limits (body bytes, messages,
max_tokens, n, tools, JSON depth), prompt characters, the input rules (block, redact or log), prompt
tokens (counted only when the prompt could be over the limit), then the optional classifier. A block
is a 400 ``content_filter`` naming the rule, with zero upstream calls; a redaction rewrites the body
that goes upstream. Every hit is counted per rule and written as an audit line without the text.

On the way back, only when some rule applies to ``output``: non-stream completions are checked in
``on_response``; streams are checked in ``on_chunk`` with a bounded hold-back (``output.py``). The
core parses streams chunk by chunk only for plugins whose class overrides those hooks, so the plugin
comes in two classes: ``SafetyPlugin`` (input only; streams stay byte pass-through) and
``OutputSafetyPlugin``, which ``SafetyPlugin(config, services)`` returns when the config has output
rules. The one entry point (``plugins.safety:SafetyPlugin``) thus serves both.
"""

from __future__ import annotations

import logging
from typing import Any

from gateway.pipeline.context import ModelResponse, RequestContext
from gateway.pipeline.plugin import Plugin
from gateway.pipeline.services import Services
from plugins.safety.classifier import Classifier
from plugins.safety.config import SafetyConfig
from plugins.safety.limits import TokenCounter, check_chars, check_shape, check_tokens, may_exceed_tokens
from plugins.safety.output import StreamGuard
from plugins.safety.policy import Policies, Policy
from plugins.safety.report import SafetyMetrics, audit, content_filter
from plugins.safety.rules import Hit, redact
from plugins.safety.texts import completion_slots, content_param, prompt_slots

__all__ = ["OutputSafetyPlugin", "SafetyConfig", "SafetyPlugin"]

log = logging.getLogger("gateway.safety")
_STREAM = "safety.stream"


class SafetyPlugin(Plugin):
    name = "safety"
    Config = SafetyConfig
    default_on_error = "fail_closed"

    def __new__(cls, config: SafetyConfig, services: Services) -> SafetyPlugin:
        target = OutputSafetyPlugin if cls is SafetyPlugin and config.checks_output() else cls
        return super().__new__(target)

    def __init__(self, config: SafetyConfig, services: Services) -> None:
        super().__init__(config, services)
        self.config: SafetyConfig = config
        self.metrics = SafetyMetrics.of(services)
        self.tokens = TokenCounter()
        self.policies: Policies | None = None
        self.classifier: Classifier | None = None

    async def start(self) -> None:
        try:
            self.policies = Policies(self.config)
            if self.config.classifier is not None:
                self.classifier = Classifier(self.config.classifier, self.services.upstream)
        except ValueError as exc:
            raise ValueError(f"safety: {exc}") from None
        if self.policies.skipped_secret_types:
            log.debug(
                "safety: detect-secrets types not usable with RE2: %s", ", ".join(self.policies.skipped_secret_types)
            )
        for path in self.policies.tokenizer_paths():
            await self.tokens.preload(path)

    def policy(self, model: str) -> Policy:
        assert self.policies is not None, "start() was not awaited"
        return self.policies.get(model)

    # -- the way in ---------------------------------------------------------------------------------

    async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
        policy = self.policy(ctx.model.name)
        if not policy.enabled:
            return None
        param = content_param(ctx.endpoint)
        limits = policy.limits
        try:
            check_shape(limits, ctx, param)
            slots = prompt_slots(ctx.endpoint, ctx.body)
            if limits.max_prompt_chars is not None:
                check_chars(limits, sum(len(s.text) for s in slots), param)
            encoded = [s.text.encode() for s in slots]
            if policy.input:
                self._apply_input_rules(ctx, policy, slots, encoded, param)
            if policy.tokenizer is not None and may_exceed_tokens(limits, sum(len(b) for b in encoded)):
                await check_tokens(limits, self.tokens, policy.tokenizer, [s.text for s in slots], param)
        except Exception as exc:
            param_name = getattr(exc, "param", None)
            if getattr(exc, "code", None) not in (None, "content_filter", "tokenizer_unavailable"):
                self.metrics.limit_refusals.labels(param_name or "-").inc()
            raise
        if self.classifier is not None and slots:
            await self._classify(ctx, "\n".join(s.text for s in slots), param)
        return None

    def _apply_input_rules(
        self, ctx: RequestContext, policy: Policy, slots: list[Any], encoded: list[bytes], param: str
    ) -> None:
        blocked: Hit | None = None
        for slot, data in zip(slots, encoded, strict=True):
            hits = policy.input.scan(data)
            if not hits:
                continue
            for hit in hits:
                self._report(ctx, hit, data[hit.start : hit.end], "input")
            if blocked is None:
                blocked = next((h for h in hits if h.rule.action == "block"), None)
            redactions = [h for h in hits if h.rule.action == "redact"]
            if redactions and blocked is None:
                slot.write(redact(data, redactions).decode())
                ctx.mark_body_changed()
        if blocked is not None:
            raise content_filter(blocked.rule.id, param)

    async def _classify(self, ctx: RequestContext, text: str, param: str) -> None:
        assert self.classifier is not None
        cfg = self.classifier.config
        verdict = await self.classifier.classify(text)
        self.metrics.classifier_checks.labels(verdict).inc()
        if verdict in ("error", "timeout"):
            if cfg.on_error == "fail_closed":
                raise self.classifier.unavailable(verdict)
            log.warning("request %s: safety classifier %s; continuing (fail_open)", ctx.request_id, verdict)
            return
        if verdict == "unsafe":
            self.metrics.rule_hits.labels(cfg.rule_id, cfg.action, "input").inc()
            audit(ctx, rule=cfg.rule_id, kind="classifier", action=cfg.action, direction="input", span=text.encode())
            if cfg.action == "block":
                raise content_filter(cfg.rule_id, param)

    def _report(self, ctx: RequestContext, hit: Hit, span: bytes, direction: str) -> None:
        rule = hit.rule
        self.metrics.rule_hits.labels(rule.id, rule.action, direction).inc()
        audit(ctx, rule=rule.id, kind=rule.kind, action=rule.action, direction=direction, span=span)


class OutputSafetyPlugin(SafetyPlugin):
    """SafetyPlugin with output checks (chosen by ``SafetyPlugin.__new__`` when rules apply to output)."""

    async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
        await super().on_request(ctx)
        policy = self.policy(ctx.model.name)
        if not policy.enabled or not policy.output:
            ctx.step_aside(self)  # this model has no output rules: its streams need no parsing
        return None

    async def on_response(self, ctx: RequestContext, response: ModelResponse) -> ModelResponse | None:
        if response.status != 200 or _STREAM in ctx.state:
            return None  # an error, or a stream already checked chunk by chunk
        policy = self.policy(ctx.model.name)
        if not policy.enabled or not policy.output:
            return None
        obj = response.json
        changed = False
        for choice, slot in completion_slots(obj):
            data = slot.text.encode()
            hits = policy.output.scan(data)
            if not hits:
                continue
            for hit in hits:
                self._report(ctx, hit, data[hit.start : hit.end], "output")
            blocked = next((h for h in hits if h.rule.action == "block"), None)
            cut = len(data) if blocked is None else blocked.start
            redactions = [h for h in hits if h.rule.action == "redact" and h.end <= cut]
            if blocked is None and not redactions:
                continue
            slot.write(redact(data[:cut], redactions).decode())
            if blocked is not None:
                choice["finish_reason"] = "content_filter"
            changed = True
        if not changed:
            return None
        response.replace_json(obj)
        return response

    async def on_chunk(self, ctx: RequestContext, chunk: dict[str, Any]) -> dict[str, Any] | None:
        guard = self._stream_guard(ctx)
        if guard is None:
            return chunk
        choices = chunk.get("choices")
        if not choices:
            return chunk  # the usage chunk
        keep = False
        for choice in choices:
            delta = choice.get("delta")
            piece = (delta.get("content") if isinstance(delta, dict) else choice.get("text")) or ""
            final = choice.get("finish_reason") is not None
            release = guard.feed(choice.get("index", 0), piece, final=final)
            if isinstance(delta, dict):
                if "content" in delta or release.text:
                    delta["content"] = release.text
                keep = keep or bool(release.text) or any(k != "content" for k in delta)
            else:
                choice["text"] = release.text
                keep = keep or bool(release.text)
            if release.blocked is not None:
                choice["finish_reason"] = "content_filter"
                ctx.state["close_stream"] = True
            keep = keep or choice.get("finish_reason") is not None
        return chunk if keep else None

    def _stream_guard(self, ctx: RequestContext) -> StreamGuard | None:
        """This stream's hold-back state, made on its first chunk (None: no output rules for the model)."""
        if _STREAM in ctx.state:
            guard: StreamGuard | None = ctx.state[_STREAM]
            return guard
        policy = self.policy(ctx.model.name)
        guard = None
        if policy.enabled and policy.output:
            guard = StreamGuard(
                policy.output,
                self.config.output.hold_back_chars,
                lambda hit, span: self._report(ctx, hit, span, "output"),
            )
        ctx.state[_STREAM] = guard
        return guard
