"""An Anthropic conversation (``system`` and the ``messages`` turns) as chat completions messages.

The translation follows vLLM's own Anthropic entrypoint (``vllm/entrypoints/anthropic/serving.py``) block
by block, so a conversation reaches the model the same through the gateway as on a worker's
``/v1/messages``: text and image blocks become content parts, ``tool_use`` blocks an assistant message's
``tool_calls``, ``tool_result`` blocks ``tool`` messages, echoed ``thinking`` blocks are dropped. A block
that cannot be translated is a 400 naming it (``messages.3.content.1``). Pure functions: no I/O.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.wire.errors import InvalidRequest

_ROLES = ("user", "assistant")
#: How Claude Code's attribution system block starts (``x-anthropic-billing-header: cc_version=...; cch=...;``).
_BILLING_HEADER = "x-anthropic-billing-header"
#: A base64 image's ``media_type``: the ones Anthropic's API takes.
_IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def bad(message: str, param: str, code: str | None = None) -> InvalidRequest:
    """A 400 naming the field at fault, as Anthropic's API names it."""
    return InvalidRequest(message, param=param, code=code)


def conversation(system: object, turns: list[Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The chat messages (system first) for a request's ``system`` and turns, and the chat options a
    final assistant turn asks for (``_prefill``)."""
    messages = _system(system)
    for i, turn in enumerate(turns):
        _append_turn(messages, turn, f"messages.{i}")
    return messages, _prefill(messages)


def _prefill(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """A final assistant turn is the start of the answer (Anthropic's prefill): the model continues it
    instead of starting a turn of its own, which vLLM does with ``continue_final_message`` and no
    generation prompt. Anthropic refuses such a turn that ends with whitespace; so does the gateway."""
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant" or last.get("tool_calls"):
        return {}
    content = last["content"]
    text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
    if text != text.rstrip():
        raise bad("messages: final assistant content cannot end with trailing whitespace", "messages")
    return {"continue_final_message": True, "add_generation_prompt": False}


def _system(system: object) -> list[dict[str, Any]]:
    """The system message: the string, or the text blocks joined, without Claude Code's attribution block
    (``_BILLING_HEADER``), which vLLM's entrypoint drops too. That block comes first and holds a hash that
    changes with every request, so kept, no two requests of a session would share a prompt prefix: the
    worker's prefix cache, routing's prefix affinity and the answer cache would all miss on every turn."""
    if system is None:
        return []
    if isinstance(system, str):
        text = system
    elif isinstance(system, list):
        parts = []
        for i, block in enumerate(system):
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise bad(f"system.{i}: system blocks must be text blocks", f"system.{i}")
            if not block["text"].startswith(_BILLING_HEADER):
                parts.append(block["text"])
        text = "".join(parts)
    else:
        raise bad("system: Input should be a string or a list of text blocks", "system")
    return [{"role": "system", "content": text}] if text else []


def _append_turn(messages: list[dict[str, Any]], turn: object, param: str) -> None:
    if not isinstance(turn, dict) or turn.get("role") not in _ROLES:
        raise bad(f"{param}.role: Input should be 'user' or 'assistant'", f"{param}.role")
    role, content = turn["role"], turn.get("content")
    if isinstance(content, str):
        messages.append({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise bad(f"{param}.content: Input should be a string or a list of content blocks", f"{param}.content")
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"{param}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        assert kind is None or isinstance(block, dict)
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), where)}})
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, where))
        elif kind == "tool_result" and role == "user":
            messages += _tool_messages(block, where)
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        else:
            raise bad(f"{where}: a {role} turn cannot carry a block of type {kind!r} here", f"{where}.type")
    message: dict[str, Any] = {"role": role}
    if parts:
        only_text = len(parts) == 1 and parts[0]["type"] == "text"
        message["content"] = parts[0]["text"] if only_text else parts
    if calls:
        message["tool_calls"] = calls
        message.setdefault("content", None)
    if "content" in message:  # a turn of tool results only, or of dropped thinking, adds no message
        messages.append(message)


def _image_url(source: object, where: str) -> str:
    """An image source as the ``image_url`` vLLM reads: a base64 one as a data URL of its media type (one
    of Anthropic's, JPEG when it has none, as vLLM's entrypoint assumes), a URL one as it is."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source, dict) and isinstance(source.get("data"), str):
        media_type = source.get("media_type") or "image/jpeg"
        if media_type not in _IMAGE_TYPES:  # else written into the data URL as it came: a dict's repr, a ','
            raise bad(
                f"{where}.source.media_type: Input should be one of {', '.join(_IMAGE_TYPES)}",
                f"{where}.source.media_type",
            )
        return f"data:{media_type};base64,{source['data']}"
    if kind == "url" and isinstance(source, dict) and isinstance(source.get("url"), str):
        return source["url"]
    raise bad(f"{where}.source: an image source must be base64 data or a URL", f"{where}.source")


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not isinstance(arguments, dict):
        raise bad(f"{where}: a tool_use block needs 'id', 'name' and an 'input' object", where)
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": orjson.dumps(arguments).decode()},
    }


def _tool_messages(block: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """A ``tool_result`` block as chat messages, as vLLM's entrypoint renders one: a ``tool`` message with
    its text blocks joined, then, when the result holds images (a screenshot, an image file a tool read),
    a ``user`` message with them as ``image_url`` parts, since a chat ``tool`` message carries text only."""
    call_id, content = block.get("tool_use_id"), block.get("content")
    if not isinstance(call_id, str) or not call_id:
        raise bad(f"{where}.tool_use_id: Field required", f"{where}.tool_use_id")
    texts: list[str] = []
    images: list[dict[str, Any]] = []
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind == "image":
                url = _image_url(part.get("source"), f"{where}.content.{k}")
                images.append({"type": "image_url", "image_url": {"url": url}})
            else:
                raise bad(
                    f"{where}.content.{k}: a tool result's content must be text or image blocks",
                    f"{where}.content.{k}",
                )
    elif content is not None:
        raise bad(f"{where}.content: a tool result must be a string or a list of blocks", f"{where}.content")
    text = "\n".join(texts)
    if block.get("is_error") is True:
        text = f"Error: {text}"  # the chat format has no error flag: the model reads it in the text
    out: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": call_id, "content": text}]
    if images:
        out.append({"role": "user", "content": images})
    return out
