"""``Decision.headers``: OpenAI's ``x-ratelimit-*`` headers name, for each kind, the bucket with the least
left of the key's and the tenant's (on a tie, the one that resets later), clamped to its limit."""

from __future__ import annotations

from plugins.tenancy.limits import Bucket, Decision


def bucket(scope: str, kind: str, limit: int) -> Bucket:
    return Bucket(scope, f"{scope}-name", kind, limit, f"test:{scope}:{kind}")  # type: ignore[arg-type]


def test_the_tightest_bucket_of_each_kind_in_order_requests_then_tokens() -> None:
    key_tokens, tenant_tokens = bucket("key", "tokens", 1000), bucket("tenant", "tokens", 50_000)
    key_requests, tenant_requests = bucket("key", "requests", 60), bucket("tenant", "requests", 600)
    decision = Decision(0)
    decision.remaining = {
        key_tokens: (900, 6_000),
        tenant_tokens: (120, 1_500),  # fewer left than the key's: named although its limit is larger
        tenant_requests: (599, 100),
        key_requests: (59, 1_000),
    }
    assert list(decision.headers().items()) == [
        ("x-ratelimit-limit-requests", "60"),
        ("x-ratelimit-remaining-requests", "59"),
        ("x-ratelimit-reset-requests", "1s"),
        ("x-ratelimit-limit-tokens", "50000"),
        ("x-ratelimit-remaining-tokens", "120"),
        ("x-ratelimit-reset-tokens", "1.5s"),
    ]


def test_a_tie_names_the_later_reset_and_remaining_is_clamped() -> None:
    soon, later = bucket("key", "tokens", 100), bucket("tenant", "tokens", 100)
    for order in ((soon, later), (later, soon)):
        decision = Decision(0)
        decision.remaining = {
            order[0]: (10, 200 if order[0] is soon else 90_000),
            order[1]: (10, 90_000 if order[1] is later else 200),
        }
        assert decision.headers()["x-ratelimit-reset-tokens"] == "1m30s"
    over = Decision(0)
    over.remaining = {soon: (-5, 10)}
    under = Decision(0)
    under.remaining = {soon: (500, 10)}
    assert over.headers()["x-ratelimit-remaining-tokens"] == "0"
    assert under.headers()["x-ratelimit-remaining-tokens"] == "100"
    assert "x-ratelimit-limit-requests" not in under.headers()


def test_no_buckets_no_headers() -> None:
    assert Decision(0).headers() == {}
