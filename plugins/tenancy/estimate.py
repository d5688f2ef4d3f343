"""Token counts for limits: estimated from the request on admission, taken from usage afterwards.

The admission estimate is characters / 4 (OpenAI's rule of thumb) over the text the model will read,
plus a few tokens per chat message for the template. A chat request's tool definitions and an assistant
turn's tool calls are part of that text (chat templates render them as JSON), counted by their JSON's
length. It runs on the event loop, so it only walks the parsed body: no tokenizer. The estimate is
corrected when the worker reports ``usage``.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.wire.protocol import requested_completion_tokens, requested_prompts

_PER_MESSAGE = 4  # role markers and separators of a chat template
_SCORING = frozenset({"rerank", "v2/rerank", "score"})
_PROMPTED = frozenset({"completions", "audio/transcriptions", "audio/translations"})  # their text is "prompt"
_SCORING_FIELDS = ("query", "documents", "text_1", "text_2", "queries", "items", "data_1", "data_2")


def _text_chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        total = 0
        for item in value:
            if isinstance(item, str):
                total += len(item)
            elif isinstance(item, dict):
                text = item.get("text")
                if isinstance(text, str):
                    total += len(text)
            elif isinstance(item, list | int):
                total += 4 * (len(item) if isinstance(item, list) else 1)  # token ids: 1 token ~ 4 chars
        return total
    return 0


def _json_chars(value: Any) -> int:
    """The length of ``value`` as JSON: how a chat template renders tool definitions and tool calls."""
    if not value:
        return 0
    try:
        return len(orjson.dumps(value))
    except TypeError:  # not JSON (a plugin's object): nothing to count
        return 0


def _messages_tokens(messages: Any, chars: int) -> int:
    """The estimate of chat ``messages`` rendered by a template, with ``chars`` more characters."""
    overhead = 0
    for message in messages if isinstance(messages, list) else ():
        if isinstance(message, dict):
            chars += _text_chars(message.get("content"))
            if "tool_calls" in message:
                chars += _json_chars(message["tool_calls"])
            overhead += _PER_MESSAGE
    return -(-chars // 4) + overhead


def prompt_tokens(endpoint: str, body: dict[str, Any]) -> int:
    """An estimate of the prompt's tokens (at least 1)."""
    if endpoint == "chat/completions":
        # Tools and documents count: without them, a request whose prompt is mostly tool definitions or
        # documents (vLLM renders both into the template) would reserve almost nothing, and concurrent
        # ones could spend far past a limit before their usage is charged.
        extra = _json_chars(body.get("tools")) + _json_chars(body.get("documents"))
        return max(1, _messages_tokens(body.get("messages"), extra))
    if endpoint in _SCORING:  # a query and its documents, or pairs of texts
        return max(1, -(-sum(_text_chars(body.get(name)) for name in _SCORING_FIELDS) // 4))
    field = "prompt" if endpoint in _PROMPTED else "input"
    tokens = -(-_text_chars(body.get(field)) // 4)
    if field == "input" and "messages" in body:  # the pooling routes' chat form (vLLM's messages)
        tokens += _messages_tokens(body["messages"], 0)
    return max(1, tokens)


def prompt_count(endpoint: str, body: dict[str, Any]) -> int:
    """How many prompts the request batches: a completions request's list of strings or of token id
    lists is one completion per prompt (and per choice); everything else is one."""
    return requested_prompts(body) if endpoint == "completions" else 1


def reserved_completion(body: dict[str, Any]) -> int:
    """The most completion tokens the request allows (``max_completion_tokens`` / ``max_tokens``) x n."""
    return requested_completion_tokens(body) or 0


def reported_usage(response: dict[str, Any]) -> tuple[int | None, int] | None:
    """(prompt, completion) tokens from the response's ``usage``; without usage (a stream that did not
    ask for it) the prompt is unknown (None) and the completion is estimated from its text."""
    usage = response.get("usage")
    if isinstance(usage, dict):
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens") or 0
        if isinstance(prompt, int) and isinstance(completion, int):
            return prompt, completion
    choices = response.get("choices")
    text = response.get("text")
    if choices is None and isinstance(text, str):  # speech to text: its usage is the audio's seconds
        return None, -(-len(text) // 4)
    if not isinstance(choices, list):
        return None
    chars = 0
    for choice in choices:
        if isinstance(choice, dict):
            message = choice.get("message")
            chars += _text_chars(message.get("content") if isinstance(message, dict) else choice.get("text"))
    return None if not choices else (None, -(-chars // 4))
