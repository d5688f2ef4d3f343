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
from gateway.wire.streaming import StreamAssembler


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


_ID = b'"id":'
_CREATED = b'"created":'


def marked_events(events: bytes) -> tuple[bytes, str] | None:
    """A recorded stream's events (JSON payloads one per line, as the worker wrote them) as stored, with
    each one's id and created marked by byte replacement, not parsed, and the prefix of the stream's id;
    None unless every event carries the first one's id and created, written compactly, and no other
    member is named so (then each event goes through ``recorded_event``). The members cannot match inside
    a string value (there every quote is escaped)."""
    end = events.find(b"\n")
    try:
        first = orjson.loads(events[:end] if end >= 0 else events)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(first, dict):
        return None
    original, created = first.get("id"), first.get("created")
    if not isinstance(original, str) or type(created) is not int:
        return None
    lines = events.count(b"\n") + 1
    if not events.count(_ID) == events.count(_CREATED) == lines:
        return None
    id_member, stamp = _ID + orjson.dumps(original), _CREATED + str(created).encode()
    marked, ids = _replace_counted(events, id_member, _EVENT_ID_BYTES)
    # the whole number: not the start of a longer one
    marked, stamps = _replace_counted(marked, stamp + b",", _EVENT_CREATED_BYTES + b",")
    if stamps != lines:  # some event has created last (vLLM writes it third): another pass for those
        marked, last = _replace_counted(marked, stamp + b"}", _EVENT_CREATED_BYTES + b"}")
        stamps += last
    if ids != lines or stamps != lines:
        return None
    return marked, _id_prefix(original)


def _replace_counted(data: bytes, old: bytes, new: bytes) -> tuple[bytes, int]:
    """``data.replace(old, new)`` and how many times ``old`` was found: from the change of length when
    there is one (one pass over the data instead of two)."""
    out = data.replace(old, new)
    if len(old) == len(new):
        return out, data.count(old)
    return out, (len(data) - len(out)) // (len(old) - len(new))


def stored_body(obj: dict[str, Any]) -> bytes:
    """An answer as stored: with an id and a created, those two first and marked (the key order of a
    JSON object carries no meaning); else as it is."""
    original = obj.get("id")
    if not isinstance(original, str) or "created" not in obj:
        return orjson.dumps(obj)
    rest = dict(obj)  # a copy without the two, made in C: a comprehension tested every key in Python
    del rest["id"], rest["created"]
    return orjson.dumps({"id": _id_prefix(original) + _MARK, "created": _CREATED_MARK, **rest})


def fresh_answer_of_events(id_prefix: str, events: bytes, created: int) -> ModelResponse:
    """A streamed hit of an answer stored as its events only (``marked_events``): the events under a
    fresh ``id`` and ``created``, and the answer they add up to, assembled only if a plugin reads it."""
    new_id = id_prefix + uuid.uuid4().hex
    fresh = events.replace(_EVENT_ID_BYTES, b'"id":' + orjson.dumps(new_id)).replace(
        _EVENT_CREATED_BYTES, b'"created":' + str(created).encode()
    )

    def assemble() -> tuple[dict[str, Any], None]:
        try:
            return _assembled(fresh), None
        except (orjson.JSONDecodeError, TypeError, ValueError):  # the events were replayed as they came
            return {}, None

    return ModelResponse(assemble=assemble, chunks=fresh)


def body_of_events(id_prefix: str, events: bytes) -> bytes:
    """The answer that stored events (``marked_events``) add up to, as ``stored_body`` stores it, so
    that ``fresh_answer`` gives it a new identity with byte operations from then on. Raises what
    unreadable events raise (``orjson.JSONDecodeError``, ``ValueError``)."""
    answer = _assembled(events)
    if isinstance(answer.get("id"), str):  # the events' marker: the id's prefix goes in front of it
        answer["id"] = id_prefix + _MARK
    return stored_body(answer)


def _assembled(events: bytes) -> dict[str, Any]:
    assembler = StreamAssembler()
    for line in events.split(b"\n"):
        chunk = orjson.loads(line)
        if not isinstance(chunk, dict):
            raise ValueError("a stored event is a JSON object")
        assembler.add(chunk)
    return assembler.result()


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
