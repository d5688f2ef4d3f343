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

    requests_per_minute: int | None = Field(None, ge=1, description="rate limit (GCRA)")
    tokens_per_minute: int | None = Field(None, ge=1, description="rate limit on prompt + completion tokens")
    tokens_per_day: int | None = Field(None, ge=1, description="budget, resets at 00:00 UTC")
    tokens_per_month: int | None = Field(None, ge=1, description="budget, resets on the 1st at 00:00 UTC")


class TenantConfig(Limits):
    """A tenant: the limits all its keys share, and its place in the routing queues."""

    priority: int = Field(
        0, ge=-1000, le=1000, description="admission priority of its requests when a model is full (higher first)"
    )
    client_priority_max: int | None = Field(
        None,
        ge=-1000,
        le=1000,
        description="None: the client's priority header changes nothing; a number: the header may set the "
        "priority, capped at this value",
    )


NO_LIMITS = TenantConfig()  # a tenant the config does not name


class MediaTokens(BaseModel):
    """Tokens the admission estimate counts for one media part of a chat message. The gateway cannot
    know them (each model's processor makes its own number of tokens of an image, a clip, a video, and
    vLLM ignores OpenAI's ``detail``), so a deployment sets what its models take at most per item; the
    defaults suit common vision and audio models. Usage corrects the charge afterwards."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image: int = Field(
        2048,
        ge=0,
        le=1_000_000,
        description="an image part (image_url, input_image, image_embeds; a file part, and a part type the "
        "gateway does not know, count as one too)",
    )
    audio: int = Field(750, ge=0, le=1_000_000, description="an audio part (input_audio, audio_url, audio_embeds)")
    video: int = Field(4096, ge=0, le=1_000_000, description="a video part (video_url, video_embeds)")


class ConfigKey(BaseModel):
    """A client key declared in config.yaml (by digest). Revoke it by removing it and reloading."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=NAME_PATTERN, description="the key's name in metrics, usage and logs")
    tenant: str = Field(pattern=NAME_PATTERN, description="the tenant it belongs to (limits, cache scope)")
    hash: str = Field(description="hex HMAC-SHA256 of the key with the pepper")
    models: list[str] = Field(default_factory=lambda: ["*"], description="model names or fnmatch patterns")
    limits: Limits = Field(default_factory=Limits, description="the key's own limits")

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
    tenants: dict[str, TenantConfig] = Field(
        default_factory=dict, description="limits shared by all keys of a tenant, and its queue priority"
    )
    keys: list[ConfigKey] = Field(default_factory=list, description="client keys declared here, by digest")
    default_key_limits: Limits = Field(
        default_factory=Limits, description="limits of keys created through the admin API that name none"
    )
    pepper_env: str = Field("GATEWAY_TENANCY_PEPPER", description="env var holding the key-hashing pepper")
    redis_prefix: str = Field("gw:tenancy", min_length=1, max_length=100, description="prefix of the Redis keys")
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
    key_cache_size: int = Field(10000, ge=1, description="key lookups a replica keeps")
    reserve_max_tokens: bool = Field(
        True, description="count max_tokens on admission (as OpenAI does); refunded when usage is known"
    )
    without_max_tokens: Literal["reserve", "clamp"] = Field(
        "reserve",
        description="a request without max_tokens: reserve what it can cost ((context - prompt) x n), or clamp: "
        "set its max_tokens to what the key and tenant have left (the answer may end with finish_reason "
        "'length'; the header x-gateway-max-tokens says the limit used)",
    )
    default_context_tokens: int = Field(
        4096, ge=16, description="a model's context when neither it nor its managed worker sets max_model_len"
    )
    media_tokens: MediaTokens = Field(
        default_factory=MediaTokens,
        description="tokens the admission estimate counts for each image, audio and video part of a message: "
        "what the served models make of one at most",
    )
    batch_price_factor: float = Field(
        1.0, ge=0, le=10, description="a batch line is charged this share of its tokens (e.g. 0.5: half price)"
    )
    priority_header: str = Field(
        "x-priority", min_length=1, description="the header a tenant with client_priority_max may set priority by"
    )
    prefix_cache: Literal["tenant", "shared"] = Field(
        "tenant",
        description="tenant: a worker reuses a prompt's cached prefix for the same tenant's requests only (a "
        "cache_salt bound to the tenant); shared: for any tenant's (more reuse of common prompts, and a tenant "
        "can tell from cached_tokens or latency whether another sent a prefix)",
    )

    @field_validator("priority_header")
    @classmethod
    def _lower(cls, name: str) -> str:
        return name.lower()

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, tenants: dict[str, TenantConfig]) -> dict[str, TenantConfig]:
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
