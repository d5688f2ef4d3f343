"""What the plugin tells operators: Prometheus counters and one audit log line per rule hit.

The counters are created once per process and kept in ``services.shared`` so that a config reload
(which builds a new plugin instance) reuses them instead of registering duplicates. Audit lines never
carry the matched text: only its length and, when ``GATEWAY_AUDIT_HMAC_KEY`` is set, its
HMAC-SHA256 under that key (``span_hmac``), with the request id, rule, action and direction. A plain
digest is never logged: a card number has about 10^6 candidates once its first 6 and last 4 digits
are known, and a phone number fewer, so an unkeyed hash is reversed by trying them all. With the key
(which stays in the environment, never in the config or the log) equal matches still get equal
hashes, so an operator can correlate repeats.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass

from prometheus_client import Counter

from gateway.pipeline.context import RequestContext
from gateway.pipeline.services import Services
from gateway.wire.errors import InvalidRequest

audit_log = logging.getLogger("gateway.safety")
_SHARED_KEY = "safety"


@dataclass(frozen=True)
class SafetyMetrics:
    rule_hits: Counter
    limit_refusals: Counter
    classifier_checks: Counter
    unread_prompts: Counter

    @classmethod
    def of(cls, services: Services) -> SafetyMetrics:
        """The process's safety metrics, registered on first use."""
        existing = services.shared.get(_SHARED_KEY)
        if isinstance(existing, SafetyMetrics):
            return existing
        registry = services.metrics.registry
        metrics = cls(
            rule_hits=Counter(
                "gateway_safety_rule_hits",
                "Safety rule matches, by rule, action (block|redact|log) and direction (input|output)",
                ["rule", "action", "direction"],
                registry=registry,
            ),
            limit_refusals=Counter(
                "gateway_safety_limit_refusals",
                "Requests refused by a safety limit, by field",
                ["param"],
                registry=registry,
            ),
            classifier_checks=Counter(
                "gateway_safety_classifier_checks",
                "Model-based safety checks, by outcome (safe|unsafe|error|timeout)",
                ["outcome"],
                registry=registry,
            ),
            unread_prompts=Counter(
                "gateway_safety_unread_prompts",
                "Prompts given as token ids that passed unread because every check on them only logs, by field",
                ["param"],
                registry=registry,
            ),
        )
        services.shared[_SHARED_KEY] = metrics
        return metrics


def audit(
    ctx: RequestContext, *, rule: str, kind: str, action: str, direction: str, span: bytes, key: bytes | None
) -> None:
    fields: dict[str, object] = {
        "request_id": ctx.request_id,
        "model": ctx.model.name,
        "rule": rule,
        "kind": kind,
        "action": action,
        "direction": direction,
        "span_bytes": len(span),
    }
    if key:
        fields["span_hmac"] = hmac.new(key, span, hashlib.sha256).hexdigest()
    audit_log.info("safety rule matched", extra={"fields": fields})


def content_filter(rule_id: str, param: str) -> InvalidRequest:
    """The refusal a client sees: names the rule, never the matched text."""
    return InvalidRequest(
        f"The request was refused by the gateway's content policy (rule '{rule_id}'). "
        "Remove the flagged content and try again.",
        param=param,
        code="content_filter",
    )


def token_ids_refused(param: str) -> InvalidRequest:
    """The refusal of a prompt given as token ids where a rule must read the prompt's text: the gateway
    has no tokenizer to decode the ids with, so their text cannot be checked."""
    return InvalidRequest(
        f"'{param}' is given as token ids, which this model's content policy cannot check: the gateway reads "
        f"prompts as text and does not decode token ids. Send '{param}' as text.",
        param=param,
        code="token_ids_not_allowed",
    )
