"""A worker's chat completion as the translations into other APIs (Messages, Responses) read it: choice 0
of a whole answer (``first_choice``) or of each stream chunk (``first_choice_deltas``), with its text, its
reasoning (``reasoning_of``: a reasoning model's thinking, which a worker started with a reasoning parser
writes apart from the text), its ``finish_reason`` and its tool calls, checked for the types the chat API
gives them. Pure: no I/O.

An answer of another shape (no ``choices`` list, a choice without its ``message``, a ``finish_reason`` or
``content`` that is not a string, a tool call that is not an object, ...) is the worker's failure, not the
gateway's: it raises ``BadGateway`` naming what was wrong (a 502, or a stream's error event), so no
translation builds its answer from what could be read of it. Only ``usage`` is read leniently (``count``:
a count that is not a number counts 0), as the proxy reads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gateway.wire.errors import BadGateway
from gateway.wire.streaming import REASONING_FIELDS

#: A tool call as read: the call (whole, or a stream's delta of one) and its ``function``.
ToolCall = tuple[dict[str, Any], dict[str, Any]]


def malformed(what: str) -> BadGateway:
    return BadGateway(f"The model worker's answer is not a valid chat completion: {what}.", code="upstream_error")


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}  # fmt: skip


def json_type(value: object) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def member(obj: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``obj[name]`` when it is absent, null or of ``kind``; anything else is a malformed answer."""
    value = obj.get(name)
    if value is not None and not isinstance(value, kind):
        raise malformed(f"{where}{name} is {json_type(value)}")
    return value


#: The largest token count of a ``usage`` believed. No request comes near it, and a prompt's and a
#: completion's together stay within 2^53, what the doubles of tenancy's Redis scripts hold exactly (a
#: worker's 2^63 failed the charge as if Redis were down; 2^53 spent a tenant's budget for good).
MAX_COUNT = 2**52


def count(value: object) -> int | None:
    """A token count of ``usage``, or None when it is not one (not an integer, negative, or past
    ``MAX_COUNT``: read leniently, it counts 0; billing then counts the answer's text or stream events)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT:
        return value
    return None


def reasoning_of(answer: dict[str, Any]) -> str:
    """The thinking of a checked message or delta (``""``: none), under whichever of its two names the
    worker writes it (``gateway.wire.streaming.REASONING_FIELDS``)."""
    for name in REASONING_FIELDS:
        if answer.get(name):
            return str(answer[name])
    return ""


def _tool_call(call: object, where: str) -> ToolCall:
    """A chat tool call (whole, or a stream's delta of one) and its ``function``, checked for the members
    the translations read."""
    if not isinstance(call, dict):
        raise malformed(f"{where} is {json_type(call)}, not an object")
    function = member(call, "function", dict, f"{where}.") or {}
    member(call, "id", str, f"{where}.")
    member(call, "index", int, f"{where}.")  # a stream's calls are told apart by it
    member(function, "name", str, f"{where}.function.")
    member(function, "arguments", str, f"{where}.function.")
    return call, function


def _checked_choice(choice: dict[str, Any], part: str, where: str) -> list[ToolCall]:
    """The tool calls of a choice whose ``finish_reason`` and ``part`` (its ``message``, or a chunk's
    ``delta``: text, reasoning and tool calls) were checked."""
    member(choice, "finish_reason", str, where)
    answer = choice.get(part) or {}
    for name in ("content", *REASONING_FIELDS):
        member(answer, name, str, f"{where}{part}.")
    calls = member(answer, "tool_calls", list, f"{where}{part}.")
    return [_tool_call(call, f"{where}{part}.tool_calls[{i}]") for i, call in enumerate(calls or ())]


def first_choice(chat: object) -> tuple[dict[str, Any], dict[str, Any], list[ToolCall], object]:
    """(choice, its message, its tool calls, the answer's usage, unchecked) of a whole chat completion's
    choice 0, the only one an answer translated into another API carries; ``BadGateway`` when ``chat`` is
    not a chat completion."""
    if not isinstance(chat, dict):
        raise malformed(f"it is {json_type(chat)}, not an object")
    choices = chat.get("choices")
    if not isinstance(choices, list) or not choices:
        raise malformed("it has no list of choices")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise malformed(f"choices[0] is {json_type(choice)}, not an object")
    message = choice.get("message")
    if not isinstance(message, dict):
        raise malformed("choices[0] has no message object")
    return choice, message, _checked_choice(choice, "message", "choices[0]."), chat.get("usage")


def first_choice_deltas(chunk: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any], list[ToolCall]]]:
    """(choice, delta, its tool calls) of a chat chunk's choice 0; a chunk or choice 0 of another shape is
    a ``BadGateway`` (other choices are not read)."""
    choices = member(chunk, "choices", list, "the stream chunk's ")
    for i, choice in enumerate(choices or ()):
        if not isinstance(choice, dict):
            raise malformed(f"the stream chunk's choices[{i}] is {json_type(choice)}, not an object")
        if member(choice, "index", int, f"the stream chunk's choices[{i}].") in (0, None):
            member(choice, "delta", dict, f"the stream chunk's choices[{i}].")
            calls = _checked_choice(choice, "delta", f"the stream chunk's choices[{i}].")
            yield choice, choice.get("delta") or {}, calls
