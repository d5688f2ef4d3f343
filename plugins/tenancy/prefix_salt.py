"""Each tenant's prompts share a worker's prefix cache with that tenant's prompts only.

vLLM reuses the KV blocks of a prompt's prefix for any later request that starts the same way: the
later request is answered sooner and reports the reused tokens (``usage.prompt_tokens_details``). Shared
across tenants, that tells one tenant, a guessed prefix at a time, what another tenant's prompts begin
with. vLLM's ``cache_salt`` goes into the hash of a prompt's first block, so only requests with the same
salt share blocks. ``TenantSalts`` gives every request a salt bound to its tenant (OpenAI does not
share prompt caches between organizations either). A salt the client sent still narrows sharing, inside
its tenant only: it is hashed together with the tenant's, so no client can name another tenant's salt.
A client's salt vLLM would refuse (not a string, empty, too long, a forbidden character) is left as it
is, for the worker's own 400.

The salt is a digest of the tenant's name (and the client's salt): the same on every replica, with no
state and no secret to share (a client never sees it and cannot choose it).
"""

from __future__ import annotations

import hashlib
from typing import Any

from gateway.pipeline.context import RequestContext
from gateway.wire.allowlist import SALTED

#: vLLM's bounds on a ``cache_salt`` (``vllm.entrypoints.generate.base.protocol.validate_cache_salt``).
_MAX_SALT_CHARS = 128
_FORBIDDEN = frozenset("@/\\\x00")
#: Tenants whose own salt is kept: the configured ones and then some; past it, salts are computed again.
_KEPT = 4096


def salt_of(tenant: str, client: str = "") -> str:
    """The salt of ``tenant``'s requests, or of those that sent ``client`` as their own (32 hex digits).
    Tenant names cannot hold a NUL (``NAME_PATTERN``), so no two pairs give the same input."""
    material = f"{tenant}\x00{client}".encode()
    return hashlib.blake2b(material, digest_size=16, person=b"gw-cache-salt").hexdigest()


def _valid(client: Any) -> bool:
    return isinstance(client, str) and 0 < len(client) <= _MAX_SALT_CHARS and _FORBIDDEN.isdisjoint(client)


class TenantSalts:
    """Puts the tenant's salt on requests to the endpoints that take one (``SALTED``)."""

    __slots__ = ("_own",)

    def __init__(self) -> None:
        self._own: dict[str, tuple[str, bytes]] = {}  # tenant -> its salt, and the front of a body with it

    def apply(self, ctx: RequestContext, tenant: str) -> None:
        """Salt ``ctx``'s body for ``tenant``: add the member, or fold the client's own salt into it."""
        if ctx.endpoint not in SALTED:
            return
        body = ctx.body
        if "cache_salt" not in body:
            salt, front = self._own.get(tenant) or self._salt(tenant)
            ctx.put_member("cache_salt", salt, front)
            return
        client = body["cache_salt"]
        if client is None:  # null is no salt to vLLM: the tenant's own
            body["cache_salt"] = self._salt(tenant)[0]
        elif _valid(client):
            body["cache_salt"] = salt_of(tenant, client)
        else:
            return  # vLLM refuses it with its own 400
        ctx.mark_body_changed()

    def _salt(self, tenant: str) -> tuple[str, bytes]:
        salt = salt_of(tenant)
        kept = salt, b'{"cache_salt":"' + salt.encode() + b'",'
        if len(self._own) < _KEPT:
            self._own[tenant] = kept
        return kept
