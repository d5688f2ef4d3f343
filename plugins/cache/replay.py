"""How an answer is stored and given a new identity on a hit.

Stored answers and stream events carry markers in place of their ``id`` and ``created``, so a hit
swaps in its own with a few byte operations instead of parsing and re-serializing JSON; every other
field (``system_fingerprint`` included) stays as the worker sent it.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from gateway.pipeline.context import ModelResponse


def fresh_id(original: Any) -> str:
    """A new id in the original's style: its prefix (``chatcmpl-``, ``cmpl-``) and a new uuid4 hex."""
    return _id_prefix(original) + uuid.uuid4().hex


def _id_prefix(original: Any) -> str:
    if isinstance(original, str):
        return original[: original.index("-") + 1] if "-" in original else ""
    return "chatcmpl-"


# Stored answers and stream events carry markers in place of their id and created, so a hit swaps in
# its own with a few byte operations instead of parsing and re-serializing JSON. The markers can only
# match at the JSON structure level: inside a string value every quote is escaped. An answer is stored
# with its id (prefix + marker) and created first, at a known place; events with the bare marker.
_MARK = "\x00"
_EVENT_ID_BYTES = b'"id":"\\u0000"'
_CREATED_MARK = -1
_EVENT_CREATED_BYTES = b'"created":-1'
_BODY_HEAD = b'{"id":"'
_BODY_MARK_END = b'\\u0000","created":-1,'


def recorded_event(chunk: dict[str, Any]) -> bytes:
    """One stream event as stored: its JSON with the id and created left to each replay."""
    if "id" in chunk or "created" in chunk:
        chunk = {**chunk}
        if "id" in chunk:
            chunk["id"] = _MARK
        if "created" in chunk:
            chunk["created"] = _CREATED_MARK
    return orjson.dumps(chunk)


def stored_body(obj: dict[str, Any]) -> bytes:
    """An answer as stored: with an id and a created, those two first and marked (the key order of a
    JSON object carries no meaning); else as it is."""
    original = obj.get("id")
    if not isinstance(original, str) or "created" not in obj:
        return orjson.dumps(obj)
    rest = {k: v for k, v in obj.items() if k != "id" and k != "created"}
    return orjson.dumps({"id": _id_prefix(original) + _MARK, "created": _CREATED_MARK, **rest})


def fresh_answer(body: bytes, events: bytes, created: int) -> ModelResponse:
    """A stored answer as a new one: a fresh ``id`` and ``created`` (on the object and on every replayed
    event alike), every other field as stored. ``events``: the stored events, for a streaming hit."""
    end = body.find(_BODY_MARK_END, len(_BODY_HEAD)) if body.startswith(_BODY_HEAD) else -1
    if end >= 0:
        new_id = body[len(_BODY_HEAD) : end] + uuid.uuid4().hex.encode()
        stamp = str(created).encode()
        body = _BODY_HEAD + new_id + b'","created":' + stamp + b"," + body[end + len(_BODY_MARK_END) :]
        answer = ModelResponse(body=body)
    else:  # stored without markers (an older entry, an answer without id or created): parse it
        obj = orjson.loads(body)
        if not isinstance(obj, dict):
            raise ValueError("a stored answer is a JSON object")
        obj["id"] = fresh_id(obj.get("id"))
        obj["created"] = created
        new_id, stamp = obj["id"].encode(), str(created).encode()
        answer = ModelResponse(json=obj)
    if events:
        answer.chunks = events.replace(_EVENT_ID_BYTES, b'"id":"' + new_id + b'"').replace(
            _EVENT_CREATED_BYTES, b'"created":' + stamp
        )
    return answer
