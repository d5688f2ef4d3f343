"""The uvicorn factory: ``uvicorn gateway.asgi:app --factory`` builds the app from GATEWAY_* settings."""

from __future__ import annotations

from gateway.app import GatewayApp, create_app
from gateway.settings import Settings


def app() -> GatewayApp:
    return create_app(Settings())
