"""Input items of the Responses API: what a request's ``input`` may hold, normalized to the items the
store keeps and ``input_items`` lists (each with an ``id``), and the errors that refuse the rest.

Supported: ``message`` items (roles user, system, developer, assistant; text parts), ``function_call``
and ``function_call_output``. ``reasoning`` items (a reasoning model's thinking, which clients such as the
OpenAI SDK send back with the rest of an earlier output) are accepted and dropped: the chat templates of
vLLM's reasoning models do not take thinking back in, so they are neither sent to the worker nor stored,
as a stored response's reasoning is not replayed (``output_as_input``). Anything else (images, files,
built-in tool items) is a 400 naming it.
"""

from __future__ import annotations

import secrets
from typing import Any

from gateway.wire.errors import InvalidRequest

_MESSAGE_ROLES = frozenset({"user", "system", "developer", "assistant"})


def new_id(prefix: str) -> str:
    """``<prefix>_`` and 48 random hex digits (192 bits: ids of stored responses cannot be guessed)."""
    return f"{prefix}_{secrets.token_hex(24)}"


def bad(message: str, param: str | None, code: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=param, code=code)


def unsupported(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(message, param=param, code="unsupported_parameter")


def normalize_input(value: object) -> list[dict[str, Any]]:
    """Input as the list of items the store keeps and ``input_items`` lists (each with an ``id``)."""
    if isinstance(value, str):
        return [message_item("user", [{"type": "input_text", "text": value}])]
    if not isinstance(value, list) or not value:
        raise bad("'input' must be a string or a non-empty array of input items.", "input")
    items = [_item(item, f"input[{i}]") for i, item in enumerate(value) if not _is_reasoning(item)]
    if not items:
        raise bad("'input' holds only reasoning items; the model reads none of them.", "input")
    return items


def _is_reasoning(item: object) -> bool:
    return isinstance(item, dict) and item.get("type") == "reasoning"


def message_item(role: str, content: list[dict[str, Any]], item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("msg"), "type": "message", "role": role, "status": "completed", "content": content}


def _item(item: object, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise bad(f"'{where}' must be an object.", where)
    kind = item.get("type", "message" if "role" in item else None)
    item_id = item.get("id") if isinstance(item.get("id"), str) else None
    if kind == "message":
        role = item.get("role")
        if not isinstance(role, str) or role not in _MESSAGE_ROLES:
            raise bad(
                f"'{where}.role' must be one of {', '.join(sorted(_MESSAGE_ROLES))} (got {role!r}).", f"{where}.role"
            )
        return message_item(role, _content(item.get("content"), role, f"{where}.content"), item_id)
    if kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            if not isinstance(item.get(name), str):
                raise bad(f"'{where}.{name}' must be a string.", f"{where}.{name}")
        return {
            "id": item_id or new_id("fc"),
            "type": "function_call",
            "call_id": item["call_id"],
            "name": item["name"],
            "arguments": item["arguments"],
            "status": "completed",
        }
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str) or not item["call_id"]:
            raise bad(f"'{where}.call_id' must be a non-empty string.", f"{where}.call_id")
        output = item.get("output")
        if isinstance(output, list):
            output = text_of(_content(output, "tool", f"{where}.output"))
        if not isinstance(output, str):
            raise bad(f"'{where}.output' must be a string or an array of input_text parts.", f"{where}.output")
        return {
            "id": item_id or new_id("fco"),
            "type": "function_call_output",
            "call_id": item["call_id"],
            "output": output,
            "status": "completed",
        }
    raise unsupported(
        f"Input items of type {kind!r} are not supported by this gateway; supported: message, function_call, "
        "function_call_output, reasoning (built-in tool items need OpenAI-hosted features).",
        f"{where}.type",
    )


def _content(content: object, role: str, where: str) -> list[dict[str, Any]]:
    text_type = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        return [text_part(text_type, content)]
    if not isinstance(content, list):
        raise bad(f"'{where}' must be a string or an array of content parts.", where)
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append(text_part(text_type, part["text"]))
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "refusal", "refusal": part["refusal"]})
        else:
            raise unsupported(
                f"Content parts of type {kind!r} are not supported by this gateway (text only: input_text, "
                "output_text, refusal); the served models read text.",
                f"{where}[{i}].type",
            )
    return parts


def text_part(kind: str, text: str) -> dict[str, Any]:
    return {"type": kind, "text": text, "annotations": []} if kind == "output_text" else {"type": kind, "text": text}


def text_of(parts: list[dict[str, Any]]) -> str:
    """The text the model reads for a list of parts: one line per part, as vLLM joins a chat message's
    text parts. So every part costs at least a character (an empty or blank part is still counted by the
    limits and charges that read the chat body, as what it is: a line of the prompt)."""
    return "\n".join(p.get("text") or p.get("refusal") or "" for p in parts)


def output_as_input(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's output items, as they enter the next turn's input: its reasoning is left out,
    as the chat templates of vLLM's reasoning models leave an earlier turn's thinking out."""
    return [dict(item) for item in output if item.get("type") in ("message", "function_call")]
