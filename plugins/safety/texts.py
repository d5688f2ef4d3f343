"""Where the text of a request or a completion lives in its JSON, as writable slots.

Rules read each slot's text and a redaction writes the slot back, so the body sent upstream carries
the placeholders. Only natural-language text is covered: chat message contents (strings or ``text``
parts), completion prompts and embedding inputs given as strings. Token-id prompts, tool definitions
and tool-call arguments are not scanned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_CONTENT_PARAM = {"chat/completions": "messages", "completions": "prompt", "embeddings": "input"}


@dataclass(slots=True)
class TextSlot:
    container: Any  # the dict or list holding the text
    key: Any  # its key or index there
    text: str

    def write(self, text: str) -> None:
        self.container[self.key] = text
        self.text = text


def content_param(endpoint: str) -> str:
    """The request field that carries the prompt (named in refusals and limit errors)."""
    return _CONTENT_PARAM.get(endpoint, "messages")


def prompt_slots(endpoint: str, body: dict[str, Any]) -> list[TextSlot]:
    slots: list[TextSlot] = []
    if endpoint == "chat/completions":
        for message in body.get("messages") or ():
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, str):
                slots.append(TextSlot(message, "content", content))
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        slots.append(TextSlot(part, "text", part["text"]))
        return slots
    field = "prompt" if endpoint == "completions" else "input"
    value = body.get(field)
    if isinstance(value, str):
        slots.append(TextSlot(body, field, value))
    elif isinstance(value, list):
        slots.extend(TextSlot(value, i, item) for i, item in enumerate(value) if isinstance(item, str))
    return slots


def completion_slots(response: dict[str, Any]) -> list[tuple[dict[str, Any], TextSlot]]:
    """(choice, slot) for each choice's text in a complete chat or legacy completion."""
    out: list[tuple[dict[str, Any], TextSlot]] = []
    for choice in response.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        message = choice.get("message")
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            out.append((choice, TextSlot(message, "content", message["content"])))
        elif isinstance(choice.get("text"), str):
            out.append((choice, TextSlot(choice, "text", choice["text"])))
    return out
