"""The errors tenancy refuses a request with, in OpenAI's words: no key or an unknown one (401), a rate
limit or budget reached, or a request larger than a limit (429, with ``Retry-After`` and the
``x-ratelimit-*`` headers), Redis unreachable under ``redis_down: fail_closed`` (503). Pure: the plugin
counts each refusal by the reason given here."""

from __future__ import annotations

from gateway.wire.errors import AuthenticationFailed, GatewayError, RateLimited, ServiceUnavailable
from plugins.tenancy.budgets import exhausted, format_duration
from plugins.tenancy.limits import Decision

_RATE_NAMES = {"requests": "requests per min (RPM)", "tokens": "tokens per min (TPM)"}


def missing_key() -> AuthenticationFailed:
    return AuthenticationFailed(
        "You didn't provide an API key. You need to provide your API key in an Authorization header"
        " using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
        code="invalid_api_key",
    )


def invalid_key() -> AuthenticationFailed:
    return AuthenticationFailed(
        "Incorrect API key provided. Ask the administrator of this gateway for a valid key.",
        code="invalid_api_key",
    )


def unavailable() -> ServiceUnavailable:
    return ServiceUnavailable(
        "The gateway cannot check API keys and limits right now (its Redis is unreachable); try again shortly.",
        code="tenancy_unavailable",
        headers={"retry-after": "1"},
    )


def refusal(decision: Decision, requested: int, now: float) -> tuple[str, GatewayError]:
    """(the reason, for the refusals metric; the 429) of an admission that refused ``requested`` tokens
    (the least it needed) at ``now`` (epoch seconds, for a budget's period)."""
    headers = decision.headers()
    if decision.budget is not None:
        budget = decision.budget
        error = exhausted(budget, decision.used.get(budget, 0), requested, now)
        error.headers.update(headers)
        return f"tokens_per_{budget.period}", error
    bucket = decision.bucket
    assert bucket is not None
    cost = 1 if bucket.kind == "requests" else requested
    where = f"{bucket.scope} '{bucket.name}'"
    if decision.status == 3:
        return "request_too_large", RateLimited(
            f"Request too large for {_RATE_NAMES[bucket.kind]} on {where}: Limit {bucket.limit}, Requested"
            f" {cost}. Send a shorter prompt or a lower max_tokens.",
            code="rate_limit_exceeded",
            headers=headers,
        )
    wait_ms = max(1, decision.retry_after_ms)
    return f"{bucket.kind}_per_minute", RateLimited(
        f"Rate limit reached for {_RATE_NAMES[bucket.kind]} on {where}: Limit {bucket.limit}, Requested {cost}."
        f" Please try again in {format_duration(wait_ms)}.",
        code="rate_limit_exceeded",
        headers={**headers, "retry-after": str(-(-wait_ms // 1000)), "retry-after-ms": str(wait_ms)},
    )
