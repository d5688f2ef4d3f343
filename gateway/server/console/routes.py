"""Serving the console's files: ``console_router(assets, token_required=...)``.

``token_required=False`` on the admin port only (where every data route still needs the token);
``True`` on the public port, where the page is an admin route like the others.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Depends, Response

from gateway.server.admin_auth import require_admin
from gateway.server.console.assets import SECURITY_HEADERS, Asset


def console_router(assets: dict[str, Asset], *, token_required: bool) -> APIRouter:
    router = APIRouter(include_in_schema=False, dependencies=[Depends(require_admin)] if token_required else [])
    for path, asset in assets.items():
        router.add_api_route(path, _serve(asset), methods=["GET"])
    return router


def _serve(asset: Asset) -> Callable[[], Awaitable[Response]]:
    async def serve() -> Response:
        return Response(asset.body, media_type=asset.media_type, headers=SECURITY_HEADERS)

    return serve
