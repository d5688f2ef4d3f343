"""Process settings: read once from ``GATEWAY_*`` environment variables, changed only by a restart.

Everything that may change while the gateway runs lives in ``config.yaml`` (see ``gateway.pipeline.config``).
Secrets (admin token) live here, never in the config file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, NonNegativeInt, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GATEWAY_", extra="ignore")

    host: str = Field("127.0.0.1", description="address the gateway listens on (0.0.0.0: every interface)")
    port: int = Field(
        8000, ge=1, le=65535, description="port of the OpenAI API (and of /admin unless admin_port is set)"
    )
    config_path: Path = Field(Path("config.yaml"), description="the reloadable config file")
    workers: int = Field(1, ge=1, description="uvicorn worker processes")
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0", description="Redis for the cache, tenancy and config pub/sub state"
    )
    admin_token: SecretStr | None = Field(
        None,
        description="bearer token of the admin API; unset: the admin API answers 403 (never put it in config.yaml)",
    )
    audit_hmac_key: SecretStr | None = Field(
        None,
        description=(
            "key for the HMAC-SHA256 that audit lines (safety rule matches) carry instead of the matched text; "
            "unset: no hash is logged, only the length (a plain digest of a card or phone number is reversible)"
        ),
    )
    admin_port: int | None = Field(None, ge=1, le=65535, description="serve /admin on its own port")
    admin_hosts: str = Field(
        "",
        description=(
            "comma-separated names the admin port answers in the Host header besides IP addresses and localhost "
            "(e.g. the Service name Prometheus scrapes it by); any other Host gets a 421, so a web page on a "
            "rebinding domain cannot read it through a browser"
        ),
    )
    forwarded_allow_ips: str = Field(
        "",
        description=(
            "comma-separated addresses (or CIDRs, or *) of the proxies whose X-Forwarded-For / X-Forwarded-Proto "
            "the gateway believes (uvicorn's forwarded_allow_ips); empty (the default): none, the client address is "
            "the connection's peer, whatever a header says"
        ),
    )
    managed_workers: bool = Field(True, description="start the engine workers declared in config.yaml")
    model_dir: Path = Field(Path("models"), description="where `gateway model prepare` puts prepared models")
    log_level: str | None = Field(None, description="overrides logging.level from config.yaml")
    config_watch_s: float = Field(
        2.0, ge=0, description="re-read the config file this often and reload when its content changed (0: off)"
    )
    console_sample_s: float = Field(
        5.0, gt=0, le=60, description="the console's live charts: seconds between samples (each model keeps 180)"
    )
    config_channel: str | None = Field(
        None, description="Redis pub/sub channel on which replicas share config changes (unset: off)"
    )
    otlp_endpoint: str | None = Field(None, description="OTLP/HTTP traces endpoint, e.g. http://otel:4318 (unset: off)")
    service_name: str = Field("vllm-gateway", description="service.name on exported traces")
    keepalive_timeout_s: int = Field(
        75,
        ge=1,
        description=(
            "how long an idle client connection stays open (uvicorn's timeout_keep_alive); longer than any "
            "client's or load balancer's idle expiry, so the client always closes first"
        ),
    )
    # The front door (gateway.server.front_door): bounds on what one client may send and hold open.
    max_header_bytes: int = Field(
        32 * 1024, ge=1024, description="request line and headers together, in bytes (beyond: 431)"
    )
    max_headers: int = Field(100, ge=1, description="header fields per request (beyond: 431)")
    max_request_line_bytes: int = Field(8 * 1024, ge=256, description="the request line, in bytes (beyond: 414)")
    first_request_timeout_s: float = Field(
        15.0, gt=0, description="a new connection that sends nothing this long is closed (no reply)"
    )
    header_timeout_s: float = Field(
        30.0, gt=0, description="a request head not complete this long after its first byte: 408, closed"
    )
    body_timeout_s: float = Field(
        60.0, gt=0, description="a request body not complete this long after its head: 408, closed"
    )
    send_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a client that takes none of its answer this long (its connection's buffer full): closed, "
        "its request cancelled",
    )
    max_recording_bytes: int = Field(
        64 * 1024 * 1024,
        ge=0,
        description="bytes of stream events all the streams being recorded for the cache may hold together; a "
        "stream past it is still stored, as its answer without its events' chunking",
    )
    max_connections: int = Field(
        4096, ge=1, description="open client connections per process; a new one beyond it is answered 503 and closed"
    )
    drain_delay_s: float = Field(
        0.0,
        ge=0,
        description="on SIGTERM, answer /ready with 503 and keep serving this long before the listener closes",
    )
    upstream_client: Literal["http1", "aiohttp"] = Field(
        "http1",
        description=(
            "the HTTP client to workers: http1 (the project's own, on httptools; fastest) or aiohttp (the "
            "library it is tested against; same behaviour, more CPU per request)"
        ),
    )
    redis_client: Literal["autopipe", "redis-py"] = Field(
        "autopipe",
        description=(
            "how plugins' hot-path Redis commands are sent: autopipe (the project's own pipelining on hiredis; "
            "fastest) or redis-py (redis-py's pipeline, the library it is tested against)"
        ),
    )
    gc_thresholds: tuple[NonNegativeInt, NonNegativeInt, NonNegativeInt] = Field(
        (10_000, 10, 10),
        description=(
            "the garbage collector's thresholds (gc.set_threshold) once start-up objects are frozen, as a JSON "
            "list; Python's own are [700, 10, 10] (see bench/README.md for why the first is larger here)"
        ),
    )

    def proxy_options(self) -> dict[str, Any]:
        """uvicorn's proxy-header options for every server the gateway runs: forwarded headers are read
        only from ``forwarded_allow_ips``, and not at all by default (uvicorn's own default trusts them
        from 127.0.0.1, so anything on the host could name any address)."""
        ips = self.forwarded_allow_ips.strip()
        return {"proxy_headers": bool(ips), "forwarded_allow_ips": ips or None}

    def admin_host_names(self) -> list[str]:
        """``admin_hosts`` split at its commas, as written: ``admin_hosts.host_names`` normalises them
        (blanks, case, a trailing dot) and drops the empty ones, in one place."""
        return self.admin_hosts.split(",")

    def server_options(self) -> dict[str, Any]:
        """uvicorn's options for every server the gateway runs (the public port, the admin port): the proxy
        options, and no ``server: uvicorn`` header, which would tell anyone what serves the gateway (and
        cost a header on every answer)."""
        return {**self.proxy_options(), "server_header": False}
