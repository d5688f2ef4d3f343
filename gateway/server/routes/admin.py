"""The admin API: reload, inspect and replace the config, and plugin actions. Admin token required.

- ``POST /admin/reload``: re-read the config file named in the settings (never a path from the body).
- ``PUT /admin/config``: a new config as YAML or JSON in the body; validated, prepared, then swapped.
- ``GET /admin/config``: the running config (secrets redacted), its version (content hash) and load time.
- ``POST /admin/plugins/{name}/{action}``: the live plugin's ``on_admin(action, body)``; each one that
  succeeds writes a ``gateway.admin`` audit line naming who (``caller``) and the id it returned (a key
  made with ``create_key``, say).
- ``GET /admin/engine``: the managed vLLM workers (name, url, pid, state, restarts, last exit code, model).
- ``GET /admin/debug/tasks``: how many asyncio tasks the serving process holds, by name (leak checks).

A refused config answers 400 with the field and the reason, and the running config stays live.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from gateway.pipeline.reload import Reloader
from gateway.pipeline.runtime import RuntimeSnapshot
from gateway.server.admin_auth import require_admin
from gateway.server.routes import JSON
from gateway.server.state import AppState
from gateway.wire.errors import InvalidRequest, NotFound, PayloadTooLarge, ServiceUnavailable

audit_log = logging.getLogger("gateway.admin")
router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], include_in_schema=False)

REDACTED = "***"
# Keys whose values are credentials wherever they appear in a config (plugin sections included), matched
# by whole words of the key: "admin_token" and "api_keys" are masked, "max_tokens", "tokenizer" and
# "key_prefix" are not.
_SECRET_WORDS = frozenset(
    {"password", "passwd", "pass", "secret", "secrets", "token", "credential", "credentials", "pepper", "apikey"}
)
_SECRET_KEYS = frozenset({"keys", "api_key", "api_keys", "private", "private_key", "authorization"})
_CAMEL_WORD = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_WORD_SPLIT = re.compile(r"[^a-z0-9]+")


def is_secret_key(key: str, value: Any) -> bool:
    """Whether the value under ``key`` is a credential to mask (a bool is never one: ``auth: true``)."""
    if isinstance(value, bool) or value in (None, "", [], {}):
        return False
    name = _WORD_SPLIT.sub("_", _CAMEL_WORD.sub("_", key).lower()).strip("_")
    if name in _SECRET_KEYS or name == "auth" or name.endswith(("_api_key", "_api_keys", "_private_key")):
        return True
    return not _SECRET_WORDS.isdisjoint(name.split("_"))


_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^:/@\s]*:)[^@/\s]+@", re.I)


def redact(value: Any, key: str = "") -> Any:
    """A copy of ``value`` with credential-like keys masked and passwords cut out of URLs."""
    if key and is_secret_key(key, value):
        return REDACTED
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return _URL_PASSWORD.sub(lambda m: m.group("head") + REDACTED + "@", value)
    return value


def _reloader(request: Request) -> Reloader:
    state: AppState = request.app.state.gateway
    return state.reloader


def caller(request: Request) -> str:
    """Who made an admin call, for the audit fields (reload history, plugin actions): the principal the
    call authenticated as (the admin token, the only credential the admin API accepts) and the address
    it came from. That address is the connection's peer; an ``X-Forwarded-For`` header changes it only
    when the peer is a proxy named in ``GATEWAY_FORWARDED_ALLOW_IPS`` (``Settings.proxy_options``)."""
    host = request.client.host if request.client else "unknown address"
    return f"admin token holder from {host}"


def _live(request: Request) -> RuntimeSnapshot:
    state: AppState = request.app.state.gateway
    if not state.holder.loaded:
        raise ServiceUnavailable("The gateway has no config loaded yet.", code="not_ready")
    return state.holder.current


def describe(snapshot: RuntimeSnapshot, source: str) -> dict[str, Any]:
    config = snapshot.config.model_dump(mode="json")
    # A plugin's validated config masks its SecretStr fields; prefer it to the raw section.
    validated = {b.name: b.plugin.config for b in snapshot.pipeline.plugins}
    for entry in config.get("plugins", []):
        model = validated.get(entry["name"])
        if isinstance(model, BaseModel):
            entry["config"] = model.model_dump(mode="json")
    return {
        "version": snapshot.version,
        "loaded_at": datetime.fromtimestamp(snapshot.loaded_at, UTC).isoformat(),
        "loaded_at_unix": snapshot.loaded_at,
        "source": source,
        "config": redact(config),
    }


@router.get("/config")
async def get_config(request: Request) -> JSON:
    return JSON(describe(_live(request), _reloader(request).source))


@router.post("/reload")
async def reload_file(request: Request) -> JSON:
    result = await _reloader(request).from_file("api", who=caller(request))
    return JSON(result.as_json())


@router.put("/config")
async def put_config(request: Request) -> JSON:
    state: AppState = request.app.state.gateway
    limit = state.holder.current.config.limits.max_body_bytes if state.holder.loaded else 4 * 1024 * 1024
    body = b""
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise PayloadTooLarge(f"A config larger than {limit} bytes is not accepted.", code="request_too_large")
    if not body.strip():
        raise InvalidRequest("Send the new config (YAML or JSON) as the request body.", code="config_invalid")
    # YAML is a superset of JSON, so one safe parser serves both content types; nothing is executed.
    result = await _reloader(request).from_text(body, "api", origin="request body", who=caller(request))
    return JSON(result.as_json())


@router.post("/plugins/{name}/{action}")
async def plugin_action(name: str, action: str, request: Request) -> JSON:
    state: AppState = request.app.state.gateway
    raw = await request.body()
    try:
        body = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError:
        raise InvalidRequest("The body of a plugin action must be a JSON object.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The body of a plugin action must be a JSON object.", code="invalid_json")
    _live(request)
    with state.holder.pin() as snapshot:  # the plugin cannot be retired while its action runs
        bound = next((b for b in snapshot.pipeline.plugins if b.name == name), None)
        if bound is None:
            enabled = ", ".join(b.name for b in snapshot.pipeline.plugins) or "none"
            raise NotFound(
                f"No plugin '{name}' is enabled (enabled: {enabled}).", param="name", code="plugin_not_found"
            )
        result = await bound.plugin.on_admin(action, body)
    fields = {"who": caller(request), "plugin": name, "action": action}
    if isinstance(result.get("id"), str):  # the object it created or changed (a key id; never a secret)
        fields["id"] = result["id"]
    audit_log.info("admin plugin action", extra={"fields": fields})
    return JSON({"plugin": name, "action": action, "result": result})


@router.get("/engine")
async def engine_status(request: Request) -> JSON:
    """The managed workers this process started; ``managed: false`` when it starts none (URLs only)."""
    state: AppState = request.app.state.gateway
    if state.engine is None:
        return JSON({"managed": False, "workers": []})
    return JSON({"managed": True, "workers": state.engine.status()})


@router.get("/debug/tasks")
async def debug_tasks() -> JSON:
    """Live asyncio tasks of this process, counted by name (numbered names folded) and by the coroutine
    each runs (what tells unnamed tasks apart when a leak check fails), for soak tests."""
    tasks = asyncio.all_tasks()
    names = Counter(re.sub(r"\d+", "N", task.get_name()) for task in tasks)
    coroutines = Counter(getattr(task.get_coro(), "__qualname__", "?") for task in tasks)
    return JSON(
        {
            "pid": os.getpid(),
            "tasks": len(tasks),
            "by_name": dict(names.most_common()),
            "by_coroutine": dict(coroutines.most_common()),
        }
    )
