"""Process settings: read once from ``GATEWAY_*`` environment variables, changed only by a restart.

Everything that may change while the gateway runs lives in ``config.yaml`` (see ``gateway.pipeline.config``).
Secrets (admin token) live here, never in the config file.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, NonNegativeInt, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GATEWAY_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    config_path: Path = Path("config.yaml")
    workers: int = Field(1, ge=1, description="uvicorn worker processes")
    redis_url: str = "redis://127.0.0.1:6379/0"
    admin_token: SecretStr | None = None
    admin_port: int | None = Field(None, ge=1, le=65535, description="serve /admin on its own port")
    managed_workers: bool = Field(True, description="start the engine workers declared in config.yaml")
    model_dir: Path = Path("models")
    log_level: str | None = Field(None, description="overrides logging.level from config.yaml")
    config_watch_s: float = Field(
        2.0, ge=0, description="re-read the config file this often and reload when its content changed (0: off)"
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
    drain_delay_s: float = Field(
        0.0,
        ge=0,
        description="on SIGTERM, answer /ready with 503 and keep serving this long before the listener closes",
    )
    gc_thresholds: tuple[NonNegativeInt, NonNegativeInt, NonNegativeInt] = Field(
        (10_000, 10, 10),
        description=(
            "the garbage collector's thresholds (gc.set_threshold) once start-up objects are frozen, as a JSON "
            "list; Python's own are [700, 10, 10] (see bench/README.md for why the first is larger here)"
        ),
    )
