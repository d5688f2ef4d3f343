"""Which ``Host`` the admin port answers: a defence against DNS rebinding.

The admin port serves what no client should read (``/metrics`` with every label, the console's page)
without a token, trusting that only operators reach it. A web page on a domain its owner points at
127.0.0.1 (or at the pod's address) after it has loaded can make the victim's browser send requests
there, and read the answers as same-origin ones; the browser still sends that domain in ``Host``. So the
admin port answers only a ``Host`` that no one else's DNS can stand for:

- an IP literal: IPv4 (``10.0.0.7``, ``127.0.0.1:8001``) or bracketed IPv6 (``[::1]:8001``);
- ``localhost``;
- a name listed in ``GATEWAY_ADMIN_HOSTS`` (a Kubernetes Service name, a compose service name that
  Prometheus scrapes by).

With an optional ``:port`` after any of them. Names compare without case and without one trailing dot
(``Gateway.`` is ``gateway``). Anything else, a missing ``Host`` or two of them, is a 421
``host_not_allowed`` in OpenAI's shape, before routing.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Any

from gateway.server.cycle import Receive, Scope, Send
from gateway.server.errors_asgi import send_path_error
from gateway.wire.errors import InvalidRequest

LOCALHOST = "localhost"


def host_names(listed: Iterable[str]) -> frozenset[str]:
    """The names a ``Host`` header may carry besides IP literals: ``localhost`` and ``listed``, normalised."""
    return frozenset({LOCALHOST, *(name for name in map(_name, listed) if name)})


def _name(name: str) -> str:
    name = name.strip().lower()
    return name[:-1] if name.endswith(".") else name


def host_allowed(value: str, names: frozenset[str]) -> bool:
    """True when ``value`` (a ``Host`` header) is an IP literal or one of ``names``, with an optional port."""
    if value.startswith("["):  # [v6] or [v6]:port
        address, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not _port(rest)):
            return False
        try:
            ipaddress.IPv6Address(address)
        except ValueError:
            return False
        return True
    host, colon, port = value.partition(":")
    if colon and not _port(":" + port):  # also refuses an unbracketed v6, whose "port" has a ':'
        return False
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return _name(host) in names if host else False
    return True


def _port(text: str) -> bool:
    """``:`` then 1 to 5 digits."""
    digits = text[1:]
    return text[:1] == ":" and 0 < len(digits) <= 5 and digits.isascii() and digits.isdigit()


def host_not_allowed(hosts: list[bytes]) -> InvalidRequest:
    """The 421 for a request whose ``hosts`` (its ``Host`` header values) are not one allowed host."""
    if len(hosts) == 1:
        what = f"does not answer Host {hosts[0][:100].decode('latin-1')!r}"
    else:
        what = "needs exactly one Host header" if hosts else "needs a Host header"
    return InvalidRequest(
        f"The admin port {what}: use an IP address or localhost, or list the name in GATEWAY_ADMIN_HOSTS "
        "(comma-separated) on the gateway.",
        code="host_not_allowed",
        status=421,
    )


class HostGuard:
    """``host_allowed`` in front of the admin port's app: a request with another ``Host`` gets the 421.
    (The admin app has no WebSocket routes: a handshake there is refused whatever its ``Host``.)"""

    def __init__(self, app: Any, names: frozenset[str]) -> None:
        self.app = app
        self.names = names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            hosts = [v for k, v in scope["headers"] if k == b"host"]
            if len(hosts) != 1 or not host_allowed(hosts[0].decode("latin-1"), self.names):
                await send_path_error(host_not_allowed(hosts), scope, send)
                return
        await self.app(scope, receive, send)
