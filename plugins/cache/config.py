"""The cache plugin's ``config:`` section, validated before a config goes live."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Endpoint = Literal["chat/completions", "completions", "embeddings"]


class CacheConfig(BaseModel):
    """Policy, Redis bounds, and single-flight settings of the response cache.

    ``namespace`` is part of every key: changing it in a reload makes every older entry unreachable at
    once (they expire by their TTL), so invalidation never needs a scan.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str = Field(
        "v1",
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="part of every key: change it in a reload to invalidate every entry without a scan",
    )
    key_prefix: str = Field(
        "gwcache", min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_.-]+$", description="prefix of the Redis keys"
    )
    endpoints: tuple[Endpoint, ...] = Field(
        ("chat/completions", "completions"), description="the endpoints whose answers are cached"
    )
    only_deterministic: bool = Field(True, description="cache only temperature 0 or seeded requests")
    default_ttl_s: int = Field(3600, ge=0, description="0 disables caching for models without their own TTL")
    model_ttl_s: dict[str, int] = Field(default_factory=dict, description="per-model TTL (0: never cache)")
    max_value_bytes: int = Field(1024 * 1024, ge=256, description="larger answers are not stored")
    default_scope: str = Field("public", min_length=1, description="the key scope when no tenant is set")

    timeout_ms: float = Field(50.0, gt=0, le=5000, description="bound on each Redis call on the request path")
    breaker_failures: int = Field(3, ge=1, description="consecutive Redis failures that open the breaker")
    breaker_cooldown_s: float = Field(5.0, gt=0, description="how long an open breaker skips Redis")
    max_pending_writes: int = Field(1000, ge=1, description="stores in flight; beyond it answers are not stored")

    coalesce: bool = Field(True, description="one upstream call for concurrent identical misses (all replicas)")
    coalesce_wait_s: float = Field(30.0, gt=0, description="longest wait for another request's answer")
    lock_ttl_s: float = Field(60.0, gt=0, description="a crashed leader's lock expires after this")
    poll_interval_ms: float = Field(25.0, gt=0, description="longest gap between checks while waiting")

    def ttl_for(self, model: str) -> int:
        return self.model_ttl_s.get(model, self.default_ttl_s)
