"""The tenancy plugin's ``config:`` section: auth switch, tenants, keys held as hashes, limits.

Keys are never written in config.yaml, only their digests (``python -m plugins.tenancy hash-key``
prints one). The pepper that goes into each digest is a secret, so it is read from the environment
variable named by ``pepper_env``, never from this file.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

NAME_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


class Limits(BaseModel):
    """Limits of one key or one tenant. ``None`` means unlimited."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    tokens_per_day: int | None = Field(None, ge=1, description="budget, resets at 00:00 UTC")
    tokens_per_month: int | None = Field(None, ge=1, description="budget, resets on the 1st at 00:00 UTC")


class ConfigKey(BaseModel):
    """A client key declared in config.yaml (by digest). Revoke it by removing it and reloading."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=NAME_PATTERN)
    tenant: str = Field(pattern=NAME_PATTERN)
    hash: str = Field(description="hex HMAC-SHA256 of the key with the pepper")
    models: list[str] = Field(default_factory=lambda: ["*"], description="model names or fnmatch patterns")
    limits: Limits = Field(default_factory=Limits)

    @field_validator("hash")
    @classmethod
    def _hex_digest(cls, value: str) -> str:
        value = value.removeprefix("sha256:").lower()
        if not _DIGEST.match(value):
            raise ValueError("must be a 64-character hex digest (python -m plugins.tenancy hash-key)")
        return value


class TenancyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    auth: bool = Field(True, description="require a client key; false: every request is anonymous_tenant")
    anonymous_tenant: str = Field("local", pattern=NAME_PATTERN, description="tenant of requests when auth is off")
    tenants: dict[str, Limits] = Field(default_factory=dict, description="limits shared by all keys of a tenant")
    keys: list[ConfigKey] = Field(default_factory=list)
    default_key_limits: Limits = Field(
        default_factory=Limits, description="limits of keys created through the admin API that name none"
    )
    pepper_env: str = Field("GATEWAY_TENANCY_PEPPER", description="env var holding the key-hashing pepper")
    redis_prefix: str = Field("gw:tenancy", min_length=1, max_length=100)
    redis_timeout_ms: float = Field(250, gt=0, le=5000, description="bound on every Redis call")
    redis_down: Literal["fail_closed", "fail_open"] = Field(
        "fail_closed",
        description="fail_closed: refuse with 503 while Redis is unreachable; fail_open: enforce the limits "
        "per replica in process (budgets are not enforced meanwhile)",
    )
    fail_open_share: float = Field(
        1.0, gt=0, le=1, description="share of each limit one replica allows alone while Redis is down"
    )
    key_cache_ttl_s: float = Field(
        0.5, gt=0, le=1.0, description="how long a replica trusts a key lookup; bounds revocation delay"
    )
    key_cache_size: int = Field(10000, ge=1)
    reserve_max_tokens: bool = Field(
        True, description="count max_tokens on admission (as OpenAI does); refunded when usage is known"
    )

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, tenants: dict[str, Limits]) -> dict[str, Limits]:
        bad = [name for name in tenants if not re.match(NAME_PATTERN, name)]
        if bad:
            raise ValueError(f"tenant names may use letters, digits and _.:- only: {', '.join(bad)}")
        return tenants

    @model_validator(mode="after")
    def _unique_keys(self) -> TenancyConfig:
        for attr in ("id", "hash"):
            values = [getattr(k, attr) for k in self.keys]
            dupes = sorted({v for v in values if values.count(v) > 1})
            if dupes:
                shown = dupes if attr == "id" else [f"{d[:8]}..." for d in dupes]
                raise ValueError(f"keys: {attr} used twice: {', '.join(shown)}")
        return self
