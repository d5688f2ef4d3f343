"""What the plugin tells operators: Prometheus counters and one audit log line per rule hit.

The counters are created once per process and kept in ``services.shared`` so that a config reload
(which builds a new plugin instance) reuses them instead of registering duplicates. Audit lines never
carry the matched text: only its SHA-256 and length, with the request id, rule, action and direction.
"""

from __future__ import annotations

import hashlib
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
        )
        services.shared[_SHARED_KEY] = metrics
        return metrics


def audit(ctx: RequestContext, *, rule: str, kind: str, action: str, direction: str, span: bytes) -> None:
    audit_log.info(
        "safety rule matched",
        extra={
            "fields": {
                "request_id": ctx.request_id,
                "model": ctx.model.name,
                "rule": rule,
                "kind": kind,
                "action": action,
                "direction": direction,
                "span_sha256": hashlib.sha256(span).hexdigest(),
                "span_bytes": len(span),
            }
        },
    )


def content_filter(rule_id: str, param: str) -> InvalidRequest:
    """The refusal a client sees: names the rule, never the matched text."""
    return InvalidRequest(
        f"The request was refused by the gateway's content policy (rule '{rule_id}'). "
        "Remove the flagged content and try again.",
        param=param,
        code="content_filter",
    )
