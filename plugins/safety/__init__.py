"""Safety: screen prompts before they reach cache or engine, and optionally check completions.

On the way in (``on_request``), in this order, all per model: shape limits (body bytes, messages,
max_tokens, n, tools, JSON depth), a prompt given as token ids (refused where a rule or the classifier
would act on its text, since the gateway cannot decode ids; counted and passed where they only log),
prompt characters, the input rules (block, redact or log) over every text the model will read
(``texts.py``), normalised (``normalize.py``) and joined across messages and parts (``scan.py``), prompt
tokens (counted only when the prompt could be over the limit; token ids one each), then the optional
classifier. A block is a 400 ``content_filter`` naming the rule, with zero upstream calls; a redaction
rewrites the body that goes upstream. Every hit is counted per rule and written as an audit line without
the text (``report.py``: its length, and a keyed hash only when a key is set).

``POST /tokenize`` and ``/detokenize`` run no rules (nothing is generated) but get the same limits
(``on_side_request``, ``side.py``).

On the way back, only when some rule applies to ``output``: non-stream completions are checked in
``on_response``; streams are checked in ``on_chunk`` with a bounded hold-back (``output.py``). The
core parses streams chunk by chunk only for plugins whose class overrides those hooks, so the plugin
comes in two classes: ``SafetyPlugin`` (input only; streams stay byte pass-through) and
``OutputSafetyPlugin``, which ``SafetyPlugin(config, services)`` returns when the config has output
rules. The one entry point (``plugins.safety:SafetyPlugin``) thus serves both.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gateway.pipeline.context import ModelResponse, RequestContext
from gateway.pipeline.plugin import Plugin, SideCall
from gateway.pipeline.services import Services
from plugins.safety.classifier import Classifier
from plugins.safety.config import SafetyConfig
from plugins.safety.limits import TokenCounter, check_chars, check_shape, check_tokens, may_exceed_tokens
from plugins.safety.output import StreamGuard
from plugins.safety.policy import Policies, Policy
from plugins.safety.report import SafetyMetrics, audit, content_filter, token_ids_refused
from plugins.safety.rules import Hit, Rule, RuleSet
from plugins.safety.scan import INLINE_SCAN_CHARS, Finding, clip, redact_texts, scan_texts
from plugins.safety.side import bound_side_call
from plugins.safety.texts import (
    ANSWER_TEXT_FIELDS,
    TOKEN_ID_ENDPOINTS,
    TextSlot,
    completion_slots,
    content_param,
    prompt_slots,
    prompt_token_ids,
)

__all__ = ["OutputSafetyPlugin", "SafetyConfig", "SafetyPlugin"]

log = logging.getLogger("gateway.safety")
_STREAM = "safety.stream"
_FIELDS = "safety.fields"  # per choice index: the reasoning/refusal fields held
_TOOL_CALLS = "safety.tool_calls"  # per choice index: the indices of the tool calls that hold arguments back
#: Refusals on the way in that are not a limit (not counted in ``gateway_safety_limit_refusals``).
_NOT_LIMIT_CODES = frozenset({None, "content_filter", "tokenizer_unavailable", "token_ids_not_allowed"})


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
        secret = services.settings.audit_hmac_key
        self.audit_key: bytes | None = secret.get_secret_value().encode() if secret is not None else None
        # Prompts longer than INLINE_SCAN_CHARS are scanned on this thread, off the event loop. One: the scan
        # holds the GIL most of the time, so a second would not scan faster, only take more of the loop's
        # turns; large prompts queue for it instead. No thread starts before the first such prompt.
        self._scanner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="safety-scan")

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

    async def aclose(self) -> None:
        # Retired once its in-flight requests drained, so nothing is queued; a scan whose request was
        # cancelled runs to its end on its own, then the thread exits.
        self._scanner.shutdown(wait=False)

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
            check_shape(limits, ctx.body, ctx.raw_body, param)
            slots = prompt_slots(ctx.endpoint, ctx.body)
            ids = prompt_token_ids(ctx.endpoint, ctx.body) if ctx.endpoint in TOKEN_ID_ENDPOINTS else 0
            if ids:
                self._unread_prompt(policy, param)
            chars = sum(len(s.text) for s in slots) if policy.input or limits.max_prompt_chars is not None else 0
            if limits.max_prompt_chars is not None:
                check_chars(limits, chars, param)
            if policy.input:
                findings = await self._scan(policy.input, [s.text for s in slots], [s.group for s in slots], chars)
                self._apply_input_rules(ctx, slots, findings, param)
            tokenizer = policy.tokenizer
            if tokenizer is not None and may_exceed_tokens(limits, ids + sum(len(s.text.encode()) for s in slots)):
                await check_tokens(limits, self.tokens, tokenizer, [s.text for s in slots], param, ids=ids)
        except Exception as exc:
            param_name = getattr(exc, "param", None)
            if getattr(exc, "code", None) not in _NOT_LIMIT_CODES:
                self.metrics.limit_refusals.labels(param_name or "-").inc()
            raise
        if self.classifier is not None and slots:
            await self._classify(ctx, "\n".join(s.text for s in slots), param)
        return None

    def _unread_prompt(self, policy: Policy, param: str) -> None:
        """A prompt given as token ids, which no rule can read (the gateway does not decode them). Where
        a rule or the classifier would act on the prompt, it is refused: text no rule can read must not
        pass as if it were clean. Where every check only logs, the request passes (an observe-only policy
        must not change what clients get) and ``gateway_safety_unread_prompts`` counts it."""
        classifier_blocks = self.classifier is not None and self.classifier.config.action == "block"
        if policy.input.acts or classifier_blocks:
            raise token_ids_refused(param)
        if policy.input or self.classifier is not None:
            self.metrics.unread_prompts.labels(param).inc()

    async def on_side_request(self, call: SideCall) -> None:
        """``/tokenize`` and ``/detokenize`` get the model's size and count bounds (``side.py``)."""
        if call.route not in ("tokenize", "detokenize"):
            return
        if call.model is None:  # unknown, or hidden from this caller: the default limits
            limits, tokenizer = self.config.limits, None
        else:
            policy = self.policy(call.model)
            if not policy.enabled:
                return
            limits, tokenizer = policy.limits, policy.tokenizer
        try:
            await bound_side_call(limits, tokenizer, self.tokens, call)
        except Exception as exc:
            if getattr(exc, "code", None) != "tokenizer_unavailable":
                self.metrics.limit_refusals.labels(getattr(exc, "param", None) or "-").inc()
            raise

    async def _scan(self, rules: RuleSet, texts: list[str], groups: Sequence[int], chars: int) -> list[Finding]:
        """``scan_texts`` over ``texts`` (``chars`` characters together): on the event loop up to
        ``INLINE_SCAN_CHARS``, past that on the plugin's thread. The rules take about a second over a few
        megabytes of prompt or answer, a pause every other request on the loop would wait out. The thread
        reads the texts only; the findings are acted on back on the loop."""
        if chars <= INLINE_SCAN_CHARS:
            return scan_texts(rules, texts, groups)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._scanner, scan_texts, rules, texts, groups)

    def _apply_input_rules(
        self, ctx: RequestContext, slots: list[TextSlot], findings: list[Finding], param: str
    ) -> None:
        """Act on the input rules' findings over every text the model will read (``texts.prompt_slots``,
        normalised and joined by ``scan.py``): a block refuses the request, redactions rewrite the
        original texts."""
        if not findings:
            return
        for finding in findings:
            self._report(ctx, finding.rule, finding.matched, "input")
        blocked = next((f for f in findings if f.rule.action == "block"), None)
        if blocked is not None:
            raise content_filter(blocked.rule.id, param)
        redactions = [f for f in findings if f.rule.action == "redact"]
        if redactions:
            texts = [s.text for s in slots]
            # Values before keys: a value's slot names its key, which a key slot may rename.
            for index, text in sorted(redact_texts(texts, redactions).items(), key=lambda e: slots[e[0]].is_key):
                slots[index].write(text)
            ctx.mark_body_changed()

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
            audit(
                ctx,
                rule=cfg.rule_id,
                kind="classifier",
                action=cfg.action,
                direction="input",
                span=text.encode(),
                key=self.audit_key,
            )
            if cfg.action == "block":
                raise content_filter(cfg.rule_id, param)

    def _report(self, ctx: RequestContext, rule: Rule, span: bytes, direction: str) -> None:
        self.metrics.rule_hits.labels(rule.id, rule.action, direction).inc()
        audit(ctx, rule=rule.id, kind=rule.kind, action=rule.action, direction=direction, span=span, key=self.audit_key)


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
        by_choice: dict[int, tuple[dict[str, Any], list[TextSlot]]] = {}
        for choice, slot in completion_slots(obj):
            by_choice.setdefault(id(choice), (choice, []))[1].append(slot)
        # The whole answer's size decides where each choice is scanned: n choices are n scans in a row.
        chars = sum(len(slot.text) for _, slots in by_choice.values() for slot in slots)
        for choice, slots in by_choice.values():
            texts = [slot.text for slot in slots]
            # Each field on its own, as the stream hold-back checks them (the client reads them apart).
            findings = await self._scan(policy.output, texts, range(len(texts)), chars)
            if not findings:
                continue
            for finding in findings:
                self._report(ctx, finding.rule, finding.matched, "output")
            blocked = next((f for f in findings if f.rule.action == "block"), None)
            redactions = [f for f in findings if f.rule.action == "redact"]
            if blocked is not None:
                # The text the blocked match touches first is cut where the match starts.
                slot_index, cut, _ = blocked.pieces[0]
                texts[slot_index] = texts[slot_index][:cut]
                redactions = [clip(f, slot_index, cut) for f in redactions]
                slots[slot_index].write(texts[slot_index])
                choice["finish_reason"] = "content_filter"
                changed = True
            for index, text in redact_texts(texts, redactions).items():
                slots[index].write(text)
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
            index = choice.get("index", 0)
            # The part that follows releases what the parts before it hold (thinking, then text, then
            # calls): held back until the choice ends, they would reach the client after it, out of order.
            calls = isinstance(delta, dict) and bool(delta.get("tool_calls"))
            release = guard.feed(index, piece, final=final or calls)
            blocked = release.blocked
            if isinstance(delta, dict):
                if "content" in delta or release.text:
                    delta["content"] = release.text
                if blocked is None:
                    blocked = self._guard_fields(ctx, guard, index, delta, final=final or calls or bool(piece))
                if blocked is None:
                    blocked = self._guard_tool_calls(ctx, guard, index, delta, final=final)
                keep = (
                    keep
                    or any(k not in ANSWER_TEXT_FIELDS for k in delta)
                    or any(delta.get(name) for name in ANSWER_TEXT_FIELDS)
                )
            else:
                choice["text"] = release.text
                keep = keep or bool(release.text)
            if blocked is not None:
                choice["finish_reason"] = "content_filter"
                ctx.close_stream = True
            keep = keep or choice.get("finish_reason") is not None
        return chunk if keep else None

    @staticmethod
    def _guard_fields(
        ctx: RequestContext, guard: StreamGuard, index: int, delta: dict[str, Any], *, final: bool
    ) -> Hit | None:
        """Hold back and check a delta's reasoning and refusal text like its content (each field held
        on its own); the chunk that ends the choice releases what each still holds."""
        seen: set[str] = ctx.state.setdefault(_FIELDS, {}).setdefault(index, set())
        for name in ANSWER_TEXT_FIELDS[1:]:
            piece = delta.get(name)
            if not isinstance(piece, str) and not (final and name in seen):
                continue
            seen.add(name)
            release = guard.feed((index, name), piece if isinstance(piece, str) else "", final=final)
            if name in delta or release.text:
                delta[name] = release.text
            if release.blocked is not None:
                return release.blocked
        return None

    @staticmethod
    def _guard_tool_calls(
        ctx: RequestContext, guard: StreamGuard, index: int, delta: dict[str, Any], *, final: bool
    ) -> Hit | None:
        """Hold back and check each tool call's streamed arguments like text (held per call). The chat API
        streams calls one after another, so a delta of another call first releases what the calls before it
        still hold: each call reaches the client whole before the next begins, as the Messages and Responses
        streams need (they end a call's block or item there, and take later arguments for it as the
        worker's failure). The chunk that ends the choice releases what is still held. Returns a block hit,
        if any (the deltas after it in the chunk are dropped: the stream ends there)."""
        held: set[int] = ctx.state.setdefault(_TOOL_CALLS, {}).setdefault(index, set())
        calls = delta.get("tool_calls")
        out: list[Any] = []
        blocked: Hit | None = None
        for call in calls if isinstance(calls, list) else ():
            tool_index = call.get("index") if isinstance(call, dict) else None
            if isinstance(tool_index, int):
                blocked = _release_calls(guard, index, held, out, keep=tool_index)
            if blocked is None:
                out.append(call)
                blocked = _feed_call(guard, index, call, held, final=final)
            if blocked is not None:
                break
        if final and blocked is None:
            blocked = _release_calls(guard, index, held, out, keep=None)
        if isinstance(calls, list) or out:
            delta["tool_calls"] = out
        return blocked

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
                lambda hit, span: self._report(ctx, hit.rule, span, "output"),
            )
        ctx.state[_STREAM] = guard
        return guard


def _feed_call(guard: StreamGuard, choice: int, call: Any, held: set[int], *, final: bool) -> Hit | None:
    """Screen a tool call delta's arguments, held per call (``held``: the calls that hold some); the delta
    keeps what may be sent now. Returns a block hit, if any."""
    function = call.get("function") if isinstance(call, dict) and isinstance(call.get("index"), int) else None
    piece = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(piece, str):
        return None
    assert isinstance(function, dict)
    held.add(call["index"])
    release = guard.feed((choice, call["index"]), piece, final=final)
    function["arguments"] = release.text
    return release.blocked


def _release_calls(guard: StreamGuard, choice: int, held: set[int], out: list[Any], *, keep: int | None) -> Hit | None:
    """Release what the calls of ``held`` other than ``keep`` still hold, as deltas appended to ``out``, in
    call order; they hold nothing afterwards. Returns a block hit, if any."""
    for tool_index in sorted(held - {keep}):
        held.discard(tool_index)
        release = guard.feed((choice, tool_index), "", final=True)
        if release.text:
            out.append({"index": tool_index, "function": {"arguments": release.text}})
        if release.blocked is not None:
            return release.blocked
    return None
