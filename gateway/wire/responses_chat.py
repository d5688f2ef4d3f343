"""A checked Responses request as the chat completions request the pipeline and the worker see, and
the way back from what they saw to what the store keeps.

``chat_request`` builds the chat body for the expanded conversation (instructions, earlier turns'
items, this request's input items). An assistant turn is one chat message, as vLLM's Responses entrypoint
builds it (``construct_chat_messages_with_tool_call``): calls join the assistant message before them, and
assistant text joins the message its turn's calls opened; a text after a text is a message of its own.

Plugins may rewrite that body on its way (safety redacts a secret into ``[SECRET]``); ``items_as_seen``
reads this request's input items back from the body the worker was given, so what is stored and listed
later is what the worker saw, never the raw input. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from gateway.wire.responses_items import message_item, text_of, text_part
from gateway.wire.responses_request import ResponsesRequest

#: Where an input item went in the chat messages: (message index, tool call index or None).
Slot = tuple[int, int | None]


def chat_request(req: ResponsesRequest, upstream_model: str, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completions body for ``history`` (earlier turns' items) followed by this request's input."""
    messages, _ = _messages(req, history)
    chat: dict[str, Any] = {"model": upstream_model, "messages": messages, **req.sampling}
    if req.tools:
        chat["tools"] = [{"type": "function", "function": _function(t)} for t in req.tools]
        choice = req.tool_choice
        chat["tool_choice"] = (
            {"type": "function", "function": {"name": choice["name"]}} if isinstance(choice, dict) else choice
        )
    fmt = req.text_format
    if fmt["type"] == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt["type"] == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "description", "strict") if fmt.get(k) is not None}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    if req.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    fields = (("name", tool["name"]), ("description", tool["description"]), ("parameters", tool["parameters"]))
    return {k: v for k, v in fields if v is not None}


def _messages(req: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Slot]]:
    """The chat messages, and the slot of each of this request's input items among them."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    for item in history:
        _append_message(messages, item)
    slots = [_append_message(messages, item) for item in req.input_items]
    return messages, slots


def _append_message(messages: list[dict[str, Any]], item: dict[str, Any]) -> Slot:
    kind = item["type"]
    if kind == "function_call":
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            calls = last.setdefault("tool_calls", [])
            calls.append(call)
            return len(messages) - 1, len(calls) - 1
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return len(messages) - 1, 0
    if kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        return len(messages) - 1, None
    role = "system" if item["role"] == "developer" else item["role"]
    last = messages[-1] if messages else None
    if role == "assistant" and last is not None and last["role"] == "assistant" and last.get("content") is None:
        # the text of a turn whose calls came first: one assistant message holds the turn's text and its
        # calls, as vLLM's Responses entrypoint replays one and the chat templates render a tool-calling turn
        last["content"] = text_of(item["content"])
    else:
        messages.append({"role": role, "content": text_of(item["content"])})
    return len(messages) - 1, None


# -- what the worker saw -------------------------------------------------------------------------------


def items_as_seen(req: ResponsesRequest, history: list[dict[str, Any]], body: dict[str, Any]) -> list[dict[str, Any]]:
    """This request's input items as the worker was given them in ``body`` (the chat body after every
    plugin's ``on_request``): a text a plugin rewrote is stored rewritten. When the messages no longer
    line up with the items (a plugin added or removed some), every text of the input is taken from the
    messages' tail rather than risk keeping one the worker never saw."""
    expected, slots = _messages(req, history)
    seen = body.get("messages")
    if not isinstance(seen, list) or len(seen) != len(expected):
        return _from_tail(seen if isinstance(seen, list) else [], len(expected) - (slots[0][0] if slots else 0))
    return [_as_seen(item, seen, slot) for item, slot in zip(req.input_items, slots, strict=True)]


def _as_seen(item: dict[str, Any], seen: list[Any], slot: Slot) -> dict[str, Any]:
    message = seen[slot[0]] if isinstance(seen[slot[0]], dict) else {}
    kind = item["type"]
    if kind == "function_call":
        calls = message.get("tool_calls") or []
        function = calls[slot[1]].get("function", {}) if slot[1] is not None and slot[1] < len(calls) else {}
        return {**item, "name": _text(function.get("name")), "arguments": _text(function.get("arguments"))}
    content = _text(message.get("content"))
    if kind == "function_call_output":
        return {**item, "output": content}
    if content == text_of(item["content"]):
        return item  # unchanged: keep the parts as sent
    kind_of_text = "output_text" if item["role"] == "assistant" else "input_text"
    return {**item, "content": [text_part(kind_of_text, content)]}


def _text(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # a plugin may have left content parts
        return text_of([p for p in value if isinstance(p, dict)])
    return ""


def _from_tail(seen: list[Any], count: int) -> list[dict[str, Any]]:
    out = []
    for message in seen[len(seen) - count :] if count > 0 else []:
        if isinstance(message, dict):
            role = message.get("role") if message.get("role") in ("user", "system", "assistant") else "user"
            kind_of_text = "output_text" if role == "assistant" else "input_text"
            out.append(message_item(str(role), [text_part(kind_of_text, _text(message.get("content")))]))
    return out


def instructions_as_seen(req: ResponsesRequest, body: dict[str, Any]) -> str | None:
    """The instructions as the worker was given them (the leading system message), for the echo."""
    if not req.instructions:
        return req.instructions
    seen = body.get("messages")
    first = seen[0] if isinstance(seen, list) and seen and isinstance(seen[0], dict) else {}
    return _text(first.get("content")) if first.get("role") == "system" else ""
