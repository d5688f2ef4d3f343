"""A checked Responses request as the chat completions request the pipeline and the worker see.

``chat_request`` builds the chat body for the expanded conversation (instructions, earlier turns'
items, this request's input items). Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from gateway.wire.responses_items import text_of
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
    else:  # a message
        role = "system" if item["role"] == "developer" else item["role"]
        messages.append({"role": role, "content": text_of(item["content"])})
    return len(messages) - 1, None
