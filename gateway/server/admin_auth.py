"""Who may call ``/admin``: the holder of the admin token, and nobody else.

The token is a process setting (``GATEWAY_ADMIN_TOKEN``), never part of ``config.yaml``, so a config
pushed through the admin API cannot change who may push the next one. It is sent as
``Authorization: Bearer <token>`` (or ``x-admin-token``) and compared in constant time.

- no admin token configured: the admin API is disabled (403, ``admin_disabled``) - there is no
  "trusted network" exception, because a header or a proxy can make any request look local;
- no credentials: 401;
- any other credential, including a client API key: 403.
"""

from __future__ import annotations

import hmac

from fastapi import Request
from pydantic import SecretStr

from gateway.server.state import AppState
from gateway.wire.errors import AuthenticationFailed, PermissionDenied
from gateway.wire.protocol import check_single_credentials


def presented_token(request: Request) -> str | None:
    """The credential the caller sent, if any (Bearer first, then ``x-admin-token``). A credential
    header sent twice is a 400: no reader of the request picks a different one of them."""
    check_single_credentials(request.scope["headers"])
    authorization = request.headers.get("authorization", "")
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    token = request.headers.get("x-admin-token", "").strip()
    return token or None


#: How the admin routes take the token (``presented_token``), as a 401 says it.
SEND_TOKEN = "'Authorization: Bearer <GATEWAY_ADMIN_TOKEN>' (or 'x-admin-token: <GATEWAY_ADMIN_TOKEN>')"


def check_admin(expected: SecretStr | None, presented: str | None, *, send_as: str = SEND_TOKEN) -> None:
    """Raise the OpenAI-shaped error for a caller who is not the admin; return when they are. ``send_as``
    says, in the 401, where this route reads the token."""
    if expected is None or not expected.get_secret_value():
        raise PermissionDenied(
            "The admin API is disabled: set GATEWAY_ADMIN_TOKEN on the gateway to enable it.",
            code="admin_disabled",
        )
    if presented is None:
        raise AuthenticationFailed(
            f"The admin API needs the admin token: send {send_as}.",
            code="missing_admin_token",
            headers={"www-authenticate": 'Bearer realm="gateway-admin"'},
        )
    # compare_digest on bytes: constant time in the length of the expected token, and no
    # TypeError for non-ASCII input a str comparison would raise.
    if not hmac.compare_digest(presented.encode(), expected.get_secret_value().encode()):
        raise PermissionDenied(
            "This credential may not use the admin API (client API keys never can).",
            code="invalid_admin_token",
        )


async def require_admin(request: Request) -> None:
    """FastAPI dependency guarding every admin route."""
    state: AppState = request.app.state.gateway
    check_admin(state.settings.admin_token, presented_token(request))
