"""The uvicorn factory: ``uvicorn gateway.server.asgi:app --factory`` builds the app from GATEWAY_* settings."""

from __future__ import annotations

import logging

from gateway.ops.logs import configure_logging
from gateway.ops.settings import Settings
from gateway.server.app import GatewayApp, create_app


def app() -> GatewayApp:
    settings = Settings()
    if not logging.getLogger().handlers:
        # A worker process uvicorn spawned (--workers > 1) starts with logging unconfigured; the levels
        # from config.yaml are applied once the config is loaded (lifespan).
        configure_logging(settings.log_level or "INFO")
    return create_app(settings)
